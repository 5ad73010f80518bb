//! Property tests of the frame codec: encode→decode round trips, every prefix of a
//! frame is "need more", and arbitrary bytes never panic the decoder.

use gem_proto::{FrameError, MAX_FRAME_LEN, MAX_STRING_LEN, Reply, Request};
use proptest::prelude::*;

fn string() -> impl Strategy<Value = String> {
    // Up to MAX_STRING_LEN bytes; multi-byte chars included.
    prop::collection::vec(any::<char>(), 0..300).prop_map(|cs| {
        let mut s = String::new();
        for c in cs {
            if s.len() + c.len_utf8() > MAX_STRING_LEN {
                break;
            }
            s.push(c);
        }
        s
    })
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (any::<u32>(), string()).prop_map(|(pid, gpu_uuid)| Request::Hello { pid, gpu_uuid }),
        (any::<u64>(), any::<u64>()).prop_map(|(overuse_us, burst_us)| Request::TokenRequest {
            overuse_us,
            burst_us
        }),
        any::<u64>().prop_map(|used_us| Request::Release { used_us }),
        any::<u64>().prop_map(|bytes| Request::MemAlloc { bytes }),
        any::<u64>().prop_map(|bytes| Request::MemFree { bytes }),
        Just(Request::MemQuery),
        Just(Request::Options),
        Just(Request::Drain),
        Just(Request::WantSoon),
        Just(Request::WantGate),
        Just(Request::Parks),
        any::<u64>().prop_map(|burst_us| Request::Renew { burst_us }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(busy_us, held_us, earlier_us, engine_us)| {
                Request::Busy {
                    busy_us,
                    held_us,
                    earlier_us,
                    engine_us,
                }
            }),
    ]
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        (
            any::<u16>(),
            any::<u16>(),
            any::<u64>(),
            any::<u64>(),
            any::<u32>()
        )
            .prop_map(
                |(request_milli, limit_milli, mem_limit, mem_used, window_ms)| Reply::HelloOk {
                    request_milli,
                    limit_milli,
                    mem_limit,
                    mem_used,
                    window_ms
                }
            ),
        any::<u64>().prop_map(|quota_us| Reply::Grant { quota_us }),
        (any::<bool>(), any::<u64>(), any::<u64>()).prop_map(|(granted, used, limit)| {
            Reply::MemVerdict {
                granted,
                used,
                limit,
            }
        }),
        (any::<u64>(), any::<u64>()).prop_map(|(used, limit)| Reply::MemInfo { used, limit }),
        (any::<u16>(), string()).prop_map(|(code, message)| Reply::Error { code, message }),
        Just(Reply::Yield),
        Just(Reply::Soon),
        Just(Reply::Gate),
        any::<u32>().prop_map(|busy_every| Reply::OptionsOk { busy_every }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn request_round_trips(msgs in prop::collection::vec(request(), 1..8), cut in 1usize..64) {
        let mut buf = Vec::new();
        for m in &msgs {
            m.encode_into(&mut buf).unwrap();
        }
        // Feed the stream in chunks of `cut` bytes, as a socket might deliver it.
        let mut got = Vec::new();
        let mut pending: Vec<u8> = Vec::new();
        for chunk in buf.chunks(cut) {
            pending.extend_from_slice(chunk);
            while let Some((m, n)) = Request::decode(&pending).unwrap() {
                pending.drain(..n);
                got.push(m);
            }
        }
        prop_assert!(pending.is_empty());
        prop_assert_eq!(got, msgs);
    }

    #[test]
    fn reply_round_trips(m in reply()) {
        let b = m.encode().unwrap();
        prop_assert!(b.len() <= 4 + MAX_FRAME_LEN);
        for cut in 0..b.len() {
            prop_assert_eq!(Reply::decode(&b[..cut]), Ok(None));
        }
        prop_assert_eq!(Reply::decode(&b), Ok(Some((m, b.len()))));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        for r in [Request::decode(&bytes).map(|o| o.map(|(_, n)| n)),
                  Reply::decode(&bytes).map(|o| o.map(|(_, n)| n))] {
            if let Ok(Some(n)) = r {
                prop_assert!(n <= bytes.len());
            }
        }
    }

    #[test]
    fn valid_header_random_payload_never_panics(
        kind in any::<u8>(),
        payload in prop::collection::vec(any::<u8>(), 0..80),
    ) {
        let mut f = ((payload.len() + 2) as u32).to_le_bytes().to_vec();
        f.push(1);
        f.push(kind);
        f.extend_from_slice(&payload);
        let _ = Request::decode(&f);
        let _ = Reply::decode(&f);
    }

    #[test]
    fn oversized_length_is_rejected(len in (MAX_FRAME_LEN as u32 + 1)..=u32::MAX) {
        let f = len.to_le_bytes();
        prop_assert_eq!(Request::decode(&f), Err(FrameError::BadLength(len)));
    }
}
