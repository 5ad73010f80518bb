//! Pure helpers of the `gem-share` launcher: where the hook is, how LD_PRELOAD is
//! extended, which socket template a shared directory uses.

use std::path::{Path, PathBuf};

/// Environment variable naming the hook library (overrides the default location).
pub const HOOK_ENV: &str = "KUBESHARE_HOOK";
/// File name of the hook library.
pub const HOOK_NAME: &str = kubeshare_api::layout::HOOK_LIB_NAME;

/// The socket template for a bare-metal directory: `<dir>/{client}/{gpu}.sock`, so
/// that `<dir>/<client>` is the client's `KUBESHARE_SOCKET_DIR`.
pub fn socket_template(dir: &Path) -> String {
    kubeshare_api::layout::socket_template_in(dir)
}

/// The hook to preload: `--hook`, else `$KUBESHARE_HOOK`, else `libgemhook.so.1` next
/// to `exe`, else `libgemhook.so` there (cargo's name for the cdylib), if `exists`.
pub fn hook_path(
    flag: Option<&Path>,
    env: Option<&str>,
    exe: Option<&Path>,
    exists: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    if let Some(p) = flag {
        return Some(p.to_owned());
    }
    if let Some(e) = env.filter(|e| !e.is_empty()) {
        return Some(PathBuf::from(e));
    }
    let dir = exe.and_then(Path::parent)?;
    let primary = dir.join(HOOK_NAME);
    let cargo_name = dir.join("libgemhook.so");
    if !exists(&primary) && exists(&cargo_name) {
        return Some(cargo_name);
    }
    Some(primary)
}

/// `existing` LD_PRELOAD with `hook` appended (kept once; never clobbering it).
pub fn ld_preload(existing: Option<&str>, hook: &str) -> String {
    match existing.map(str::trim).filter(|e| !e.is_empty()) {
        None => hook.to_owned(),
        Some(e) if e.split([':', ' ']).any(|x| x == hook) => e.to_owned(),
        Some(e) => format!("{e}:{hook}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_is_appended_never_clobbered() {
        assert_eq!(ld_preload(None, "/h.so"), "/h.so");
        assert_eq!(ld_preload(Some(""), "/h.so"), "/h.so");
        assert_eq!(ld_preload(Some("/a.so"), "/h.so"), "/a.so:/h.so");
        assert_eq!(ld_preload(Some("/a.so /h.so"), "/h.so"), "/a.so /h.so");
        assert_eq!(ld_preload(Some("/h.so:/a.so"), "/h.so"), "/h.so:/a.so");
    }

    #[test]
    fn hook_path_order() {
        let exe = Path::new("/opt/ks/bin/gem-share");
        let none = |_: &Path| false;
        assert_eq!(
            hook_path(Some(Path::new("/x.so")), Some("/y.so"), Some(exe), none),
            Some(PathBuf::from("/x.so"))
        );
        assert_eq!(
            hook_path(None, Some("/y.so"), Some(exe), none),
            Some(PathBuf::from("/y.so"))
        );
        assert_eq!(
            hook_path(None, Some(""), Some(exe), none),
            Some(PathBuf::from("/opt/ks/bin/libgemhook.so.1"))
        );
        // Only cargo's output is there: use it.
        let cargo_only = |p: &Path| p.ends_with("libgemhook.so");
        assert_eq!(
            hook_path(None, None, Some(exe), cargo_only),
            Some(PathBuf::from("/opt/ks/bin/libgemhook.so"))
        );
    }

    #[test]
    fn template_matches_the_client_dir() {
        assert_eq!(
            socket_template(Path::new("/tmp/s")),
            "/tmp/s/{client}/{gpu}.sock"
        );
    }
}
