//! The hook is installed and preloaded as `libgemhook.so.1`; give it that soname.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgemhook.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
