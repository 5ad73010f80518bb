//! Engine time (`engine.rs`): a capped co-runner charged the time its contexts held the
//! compute engine, its late slices carried to its next hold, never more than the wall time.

use super::corun::{fill, pair, t_and_i};
use super::*;

/// i's report of `engine_ms` held over `held_ms` of holds, at `now`.
fn report(c: &mut Core, now: Micros, engine_ms: Option<Micros>, held_ms: Micros) {
    c.busy(now, 2, 0, held_ms * MS, 0, engine_ms.map(|e| e * MS))
        .unwrap();
}

/// `pair()` with i light and co-running from t(0), in co-holds of 10 ms.
fn i_co_running() -> Core {
    let mut c = pair();
    fill(&mut c, 2, 0.55);
    assert_eq!(grant(&c.token_request(t(0), 2, 0, 0)).unwrap().0, "i");
    assert!(c.co_running("i"));
    c
}

#[test]
fn a_capped_co_hold_is_charged_the_engine_time_it_held() {
    let mut c = i_co_running();
    // Its open co-hold: what its report said, and its wall time since.
    assert_eq!(c.co_usage_us(t(4), "i"), Some(4 * MS));
    report(&mut c, t(4), Some(1), 4);
    assert_eq!(c.co_usage_us(t(8), "i"), Some(5 * MS));
    // Ten co-holds of 10 ms, each holding the engine 6 ms of it, are charged 60 ms, not 100.
    let mut now = t(0);
    for k in 1..=10 {
        now = t(10 * k);
        report(&mut c, now, Some(if k == 1 { 5 } else { 6 }), 10);
        assert_eq!(grant(&c.token_request(now, 2, 0, 0)).unwrap().0, "i");
    }
    assert_eq!(c.co_usage_us(now, "i"), Some(60 * MS));
    assert_eq!(c.usage_us(now, "i"), Some(60 * MS));
    assert_eq!(c.engine_owed_us("i"), Some(0));
}

#[test]
fn late_slices_are_charged_in_the_next_co_hold_never_past_its_wall_length() {
    let mut c = i_co_running();
    // 4 ms came by its end, 2 ms more (held in it) with the next report.
    report(&mut c, t(10), Some(4), 10);
    grant(&c.token_request(t(10), 2, 0, 0)).unwrap();
    assert_eq!(c.co_usage_us(t(10), "i"), Some(4 * MS));
    report(&mut c, t(20), Some(8), 10);
    grant(&c.token_request(t(20), 2, 0, 0)).unwrap();
    assert_eq!(c.co_usage_us(t(20), "i"), Some(12 * MS));
    // A report above the wall length is charged that; the rest stays owed, for the next.
    report(&mut c, t(30), Some(25), 10);
    grant(&c.token_request(t(30), 2, 0, 0)).unwrap();
    assert_eq!(c.co_usage_us(t(30), "i"), Some(22 * MS));
    assert_eq!(c.engine_owed_us("i"), Some(15 * MS));
    report(&mut c, t(40), Some(0), 10);
    grant(&c.token_request(t(40), 2, 0, 0)).unwrap();
    assert_eq!(c.co_usage_us(t(40), "i"), Some(32 * MS));
    assert_eq!(c.engine_owed_us("i"), Some(5 * MS));
}

#[test]
fn a_co_hold_without_engine_time_is_charged_its_wall_length() {
    let mut c = i_co_running();
    // A report that lacks it (no CUPTI 13.2, or a profiler took the records): 10 ms.
    report(&mut c, t(5), Some(1), 5);
    report(&mut c, t(10), None, 5);
    grant(&c.token_request(t(10), 2, 0, 0)).unwrap();
    assert_eq!(c.co_usage_us(t(10), "i"), Some(10 * MS));
    // No report at all (an older hook): 10 ms.
    grant(&c.token_request(t(20), 2, 0, 0)).unwrap();
    assert_eq!(c.co_usage_us(t(20), "i"), Some(20 * MS));
    // One with it: 3 ms.
    report(&mut c, t(30), Some(3), 10);
    grant(&c.token_request(t(30), 2, 0, 0)).unwrap();
    assert_eq!(c.co_usage_us(t(30), "i"), Some(23 * MS));
}

#[test]
fn a_co_hold_of_two_processes_is_charged_its_wall_length() {
    // Their reports cannot be told apart by process: either's could lack the other's slices.
    let mut c = i_co_running();
    c.hello(3, "i").unwrap();
    assert_eq!(grant(&c.token_request(t(2), 3, 0, 0)).unwrap().0, "i");
    report(&mut c, t(10), Some(1), 10);
    grant(&c.token_request(t(10), 2, 0, 0)).unwrap();
    c.release(t(12), 3, 0);
    c.release(t(14), 2, 0);
    assert_eq!(c.co_usage_us(t(14), "i"), Some(14 * MS));
}

#[test]
fn a_turn_pays_the_late_slices_up_to_its_length() {
    // Reports outside a co-hold: a capped turn is charged its whole length, which covers its
    // own engine time and late slices up to that length; the rest stays owed.
    let mut c = pair();
    report(&mut c, t(10), Some(12), 10);
    assert_eq!(c.engine_owed_us("i"), Some(2 * MS));
    report(&mut c, t(20), Some(9), 10);
    assert_eq!(c.engine_owed_us("i"), Some(MS));
    report(&mut c, t(30), Some(3), 10);
    assert_eq!(c.engine_owed_us("i"), Some(0));
    // Never more than a window's length.
    report(&mut c, t(40), Some(u64::MAX / MS), 0);
    assert_eq!(c.engine_owed_us("i"), Some(1000 * MS));
}

#[test]
fn an_uncapped_co_hold_is_charged_its_fill_whatever_its_engine_time() {
    let mut c = t_and_i(params(), (500, 500), (500, 1000), 10 * MS, 0);
    fill(&mut c, 2, 0.5);
    grant(&c.token_request(t(0), 2, 0, 0)).unwrap();
    report(&mut c, t(10), Some(2), 10);
    grant(&c.token_request(t(10), 2, 0, 0)).unwrap();
    let used = c.co_usage_us(t(10), "i").unwrap();
    assert!(used.abs_diff(5 * MS) <= MS, "{used}");
    assert_eq!(c.engine_owed_us("i"), Some(0));
}

#[test]
fn an_engine_report_before_hello_is_refused() {
    let mut c = pair();
    let e = c.busy(t(0), 7, 0, MS, 0, Some(MS)).unwrap_err();
    assert_eq!(e.code, code::PROTOCOL_MISUSE);
}

/// A step of i's in the ledger's property: a co-hold `len` ms long whose report said `engine`
/// ms, or a report in no co-hold (a turn's) of `engine` ms over `held` ms.
#[derive(Debug, Clone)]
enum Step {
    Co { len: Micros, engine: Micros },
    Turn { engine: Micros, held: Micros },
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        (1..20u64, 0..30u64).prop_map(|(len, engine)| Step::Co { len, engine }),
        (0..20u64, 0..20u64).prop_map(|(engine, held)| Step::Turn { engine, held }),
    ]
}

proptest::proptest! {
    /// Whatever the order of co-holds and turn reports and however late the engine time comes,
    /// each co-hold is charged at most its wall length, and the charges, the ledger and the
    /// turns' held time together cover every µs of engine time reported: a capped client's
    /// charges never fall below the engine time it held by more than what it still owes.
    #[test]
    fn charges_cover_the_engine_time_reported(steps in proptest::collection::vec(step(), 1..25)) {
        // Within a window (1 s) and below the ledger's cap: nothing slides out.
        let mut c = i_co_running();
        c.release(t(0), 2, 0);
        let (mut now, mut reported, mut turns_held, mut walls) = (t(1), 0, 0, 0);
        for s in steps {
            match s {
                Step::Co { len, engine } => {
                    if grant(&c.token_request(now, 2, 0, 0)).is_none() || !c.co_running("i") {
                        break;
                    }
                    now += len * MS;
                    report(&mut c, now, Some(engine), len);
                    c.release(now, 2, 0);
                    reported += engine * MS;
                    walls += len * MS;
                }
                Step::Turn { engine, held } => {
                    report(&mut c, now, Some(engine), held);
                    reported += engine * MS;
                    turns_held += held * MS;
                }
            }
            now += MS;
            let charged = c.co_usage_us(now, "i").unwrap();
            let owed = c.engine_owed_us("i").unwrap();
            proptest::prop_assert!(charged <= walls, "charged {charged} of {walls} µs of co-holds");
            proptest::prop_assert!(
                charged + owed + turns_held >= reported,
                "charged {charged} + owed {owed} + turns {turns_held} < reported {reported}"
            );
        }
    }
}
