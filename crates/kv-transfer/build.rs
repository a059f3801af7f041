//! Generates the UCP bindings (feature `ucx`) from the system's UCX headers, found by pkg-config.

fn main() {
    #[cfg(feature = "ucx")]
    ucx::generate();
}

#[cfg(feature = "ucx")]
mod ucx {
    use std::env;
    use std::path::PathBuf;

    pub fn generate() {
        println!("cargo:rerun-if-changed=build.rs");
        let lib = pkg_config::Config::new()
            .atleast_version("1.10")
            .probe("ucx")
            .unwrap_or_else(|e| {
                panic!(
                    "UCX not found by pkg-config ({e}); install libucx-dev (Debian) or build \
                     tandem-kv-transfer with --no-default-features"
                )
            });
        let mut builder = bindgen::Builder::default()
            .header_contents("tandem_ucx.h", "#include <ucp/api/ucp.h>\n")
            .allowlist_function("ucp_.*")
            .allowlist_function("ucs_status_string")
            .allowlist_type("ucp_.*")
            .allowlist_type("ucs_.*")
            .allowlist_var("UCP_.*")
            .allowlist_var("UCS_.*")
            .allowlist_var("UCP_API_.*")
            .default_enum_style(bindgen::EnumVariation::Consts)
            .prepend_enum_name(false)
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false);
        for path in &lib.include_paths {
            builder = builder.clang_arg(format!("-I{}", path.display()));
        }
        let bindings = builder
            .generate()
            .expect("bindgen failed on <ucp/api/ucp.h>");
        let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
        bindings
            .write_to_file(out.join("ucp_sys.rs"))
            .expect("writing the UCP bindings");
    }
}
