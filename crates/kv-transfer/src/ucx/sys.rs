//! Raw UCP bindings, generated ahead of time by bindgen from `<ucp/api/ucp.h>` (UCX 1.13) and
//! checked in as `sys_generated.rs` (regenerate with `scripts/ucx-bindings.sh`; a test checks
//! the file against the system's headers). Dynamic-loading mode: the functions are fields and
//! methods of [`UcpLib`], filled from `libucp.so.0` at run time by `super::library`, so
//! building needs neither the headers nor the library. The header's macros that bindgen cannot
//! translate (`UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`) are written by hand in `super::ucp`.

#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unused,
    unsafe_code,
    unreachable_pub,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]

// `include!` rather than `mod`: the file is bindgen's output as generated, which `cargo fmt`
// must not rewrite (the test compares it byte for byte).
include!("sys_generated.rs");
