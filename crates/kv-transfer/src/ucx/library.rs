//! Loads UCP at run time, once per process: `libucp.so.0` through libloading, with every
//! function of the bindings resolved up front (bindgen's `dynamic_link_require_all`, so a
//! missing symbol fails the load, never a later call), and its version checked against the
//! API the bindings were generated from. [`get`] is the only way to the loaded [`UcpLib`]: a
//! [`super::ucp::Ucp`] holds the reference it returns, and every UCX call goes through it.
//!
//! `ucs_status_string` lives in libucs, which libucp links (`DT_NEEDED`): `dlsym` on libucp's
//! handle searches the libraries loaded with it, so the one handle resolves it too (checked by
//! a test below).

#![allow(unsafe_code)]

use std::sync::OnceLock;

use super::sys::{UCP_API_MAJOR, UCP_API_MINOR, UcpLib};
use crate::error::TransferError;

/// The soname of libucp in Debian's `libucx0` (and UCX's own builds).
pub(super) const LIBUCP: &str = "libucp.so.0";

/// The loaded library, or why it could not be loaded; the outcome of the first attempt stands
/// for the life of the process (the library stays loaded until exit).
static LOADED: OnceLock<Result<UcpLib, TransferError>> = OnceLock::new();

/// The process's UCP library, loading it on first use.
pub(super) fn get() -> Result<&'static UcpLib, TransferError> {
    LOADED
        .get_or_init(|| open(LIBUCP))
        .as_ref()
        .map_err(Clone::clone)
}

fn open(soname: &'static str) -> Result<UcpLib, TransferError> {
    // SAFETY: loading libucp runs its (and libucs's and libuct's) initialisers, which only set
    // up UCX's own global state. Each symbol is given the type bindgen derived from the same
    // API's headers; the version check below refuses a library older than those headers, and
    // UCX keeps its ABI backward compatible within a major version.
    let lib = unsafe { UcpLib::new(soname) }.map_err(|e| TransferError::UcxNotFound {
        library: soname,
        detail: e.to_string(),
    })?;
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three valid out-parameters; the call has no other precondition.
    unsafe { lib.ucp_get_version(&mut major, &mut minor, &mut release) };
    require_version(major, minor, release)?;
    Ok(lib)
}

/// Accepts a runtime library of at least the bindings' API version (`UCP_API_MAJOR.MINOR`).
fn require_version(major: u32, minor: u32, release: u32) -> Result<(), TransferError> {
    if (major, minor) >= (UCP_API_MAJOR, UCP_API_MINOR) {
        Ok(())
    } else {
        Err(TransferError::UcxTooOld {
            found: format!("{major}.{minor}.{release}"),
            required: format!("{UCP_API_MAJOR}.{UCP_API_MINOR}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorClass;

    #[test]
    fn a_missing_library_is_unavailable_and_says_so() {
        let e = match open("libtandem-no-such-ucp.so.0") {
            Ok(_) => panic!("loaded a library that does not exist"),
            Err(e) => e,
        };
        assert!(matches!(e, TransferError::UcxNotFound { .. }), "{e:?}");
        assert_eq!(e.class(), ErrorClass::Unavailable);
        let message = e.to_string();
        assert!(
            message.starts_with("UCX not found (libtandem-no-such-ucp.so.0: ")
                && message.contains("cannot open shared object file"),
            "{message}"
        );
    }

    #[test]
    fn a_library_without_the_functions_is_not_ucx() {
        // glibc is always there and has none of UCP's functions: the first one bindgen's
        // `from_library` asks for fails the whole load.
        let e = match open("libc.so.6") {
            Ok(_) => panic!("libc passed for libucp"),
            Err(e) => e,
        };
        assert_eq!(e.class(), ErrorClass::Unavailable);
        let message = e.to_string();
        assert!(
            message.starts_with("UCX not found (")
                && message.contains("libc.so.6")
                && message.contains("undefined symbol"),
            "{message}"
        );
    }

    #[test]
    fn versions_older_than_the_bindings_are_refused() {
        assert!(require_version(UCP_API_MAJOR, UCP_API_MINOR, 0).is_ok());
        assert!(require_version(UCP_API_MAJOR, UCP_API_MINOR + 4, 2).is_ok());
        assert!(require_version(UCP_API_MAJOR + 1, 0, 0).is_ok());
        let e = require_version(UCP_API_MAJOR, UCP_API_MINOR - 1, 7).unwrap_err();
        assert_eq!(e.class(), ErrorClass::Unavailable);
        assert_eq!(
            e.to_string(),
            format!(
                "UCX {UCP_API_MAJOR}.{}.7 is too old: tandem's UCX bindings were generated from \
                 UCX {UCP_API_MAJOR}.{UCP_API_MINOR} and need at least that version",
                UCP_API_MINOR - 1
            )
        );
    }

    /// Needs libucx0 (the test command installs it): the library loads, is new enough, and
    /// resolved libucs's `ucs_status_string` through libucp's handle.
    #[test]
    fn libucp_loads_and_resolves_libucs_symbols() {
        let lib = get().unwrap_or_else(|e| panic!("{e} (install Debian's libucx0)"));
        assert_eq!(lib.status_string(super::super::sys::UCS_OK), "Success");
    }
}
