//! Thin wrappers over the UCP calls the engine makes: status handling, context and worker
//! set-up, memory mapping, key packing. Called only on the worker thread (and by [`probe`]).
//! A [`Ucp`] holds the loaded library (`super::library`), through which every call is made.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_void};

use super::library;
use super::sys::*;
use crate::error::TransferError;
use crate::transport::UcxConfig;

impl UcpLib {
    /// UCX's description of `status`.
    pub(super) fn status_string(&self, status: ucs_status_t) -> String {
        // SAFETY: UCX returns a pointer to a static NUL-terminated string for any status.
        unsafe { CStr::from_ptr(self.ucs_status_string(status)) }
            .to_string_lossy()
            .into_owned()
    }

    /// `Ok` for `UCS_OK`, else [`TransferError::Ucx`] naming `op` and the status.
    pub(super) fn check(
        &self,
        op: &'static str,
        status: ucs_status_t,
    ) -> Result<(), TransferError> {
        if status == UCS_OK {
            Ok(())
        } else {
            Err(TransferError::Ucx {
                op,
                detail: self.status_string(status),
            })
        }
    }
}

/// `UCS_PTR_IS_ERR`.
pub(super) fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    p as usize >= UCS_ERR_LAST as isize as usize
}

/// `UCS_PTR_STATUS`.
pub(super) fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    p as isize as ucs_status_t
}

/// Request parameters with completion callback `cb` and `token` as user data.
pub(super) fn request_param(token: u64, cb: ucp_send_nbx_callback_t) -> ucp_request_param_t {
    // SAFETY: the struct is plain C data (integers, pointers, optional function pointers and
    // unions of those): all-zero is a valid value, meaning "no fields set".
    let mut param: ucp_request_param_t = unsafe { std::mem::zeroed() };
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.user_data = token as *mut c_void;
    param.cb.send = cb;
    param
}

/// A UCP context with one worker (single-threaded, RMA + wakeup); cleaned up on drop.
pub(super) struct Ucp {
    /// The library every call on these handles goes through.
    pub(super) lib: &'static UcpLib,
    pub(super) context: ucp_context_h,
    pub(super) worker: ucp_worker_h,
}

impl Ucp {
    pub(super) fn new(config: &UcxConfig) -> Result<Ucp, TransferError> {
        let lib = library::get()?;
        let mut cfg: *mut ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file mean the defaults (`UCX_` environment); `cfg` receives
        // a config released below.
        lib.check("config read", unsafe {
            lib.ucp_config_read(std::ptr::null(), std::ptr::null(), &mut cfg)
        })?;
        let named = [("TLS", &config.tls), ("NET_DEVICES", &config.net_devices)]
            .into_iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| (k, v)));
        let options = config.effective_options();
        let extra = options.iter().map(|(k, v)| (k.as_str(), v));
        let modified = named.chain(extra).try_for_each(|(key, value)| {
            let bad = |e: std::ffi::NulError| TransferError::InvalidArgument(e.to_string());
            let k = CString::new(key).map_err(bad)?;
            let v = CString::new(value.as_str()).map_err(bad)?;
            // SAFETY: `cfg` is a live config; both strings are NUL-terminated and copied.
            lib.check("config modify", unsafe {
                lib.ucp_config_modify(cfg, k.as_ptr(), v.as_ptr())
            })
        });
        let mut context: ucp_context_h = std::ptr::null_mut();
        let init = modified.and_then(|()| {
            let params = ucp_params_t {
                field_mask: u64::from(UCP_PARAM_FIELD_FEATURES),
                features: u64::from(UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP),
                ..Default::default()
            };
            // SAFETY: `params` and `cfg` are valid for the call; `context` receives the handle.
            lib.check("init", unsafe {
                lib.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, cfg, &mut context)
            })
        });
        // SAFETY: `cfg` came from `ucp_config_read` and is released once.
        unsafe { lib.ucp_config_release(cfg) };
        init?;
        let wparams = ucp_worker_params_t {
            field_mask: u64::from(UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut worker: ucp_worker_h = std::ptr::null_mut();
        // SAFETY: `context` is live; `worker` receives the handle.
        let created = lib.check("worker create", unsafe {
            lib.ucp_worker_create(context, &wparams, &mut worker)
        });
        if let Err(e) = created {
            // SAFETY: the context was created above and has no workers.
            unsafe { lib.ucp_cleanup(context) };
            return Err(e);
        }
        Ok(Ucp {
            lib,
            context,
            worker,
        })
    }

    pub(super) fn address(&self) -> Result<Vec<u8>, TransferError> {
        let mut addr: *mut ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is live; UCX allocates `addr`, released right after the copy.
        self.lib.check("worker address", unsafe {
            self.lib
                .ucp_worker_get_address(self.worker, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from `ucp_worker_get_address` on this worker.
        unsafe { self.lib.ucp_worker_release_address(self.worker, addr) };
        Ok(bytes)
    }

    pub(super) fn event_fd(&self) -> Result<i32, TransferError> {
        let mut efd = -1;
        // SAFETY: the worker was created with UCP_FEATURE_WAKEUP; `efd` is an out-parameter.
        self.lib.check("get efd", unsafe {
            self.lib.ucp_worker_get_efd(self.worker, &mut efd)
        })?;
        Ok(efd)
    }

    pub(super) fn supports_cuda(&self) -> bool {
        let mut attr = ucp_context_attr_t {
            field_mask: u64::from(UCP_ATTR_FIELD_MEMORY_TYPES),
            ..Default::default()
        };
        // SAFETY: the context is live and `attr` is a valid out-parameter.
        let ok = unsafe { self.lib.ucp_context_query(self.context, &mut attr) } == UCS_OK;
        ok && attr.memory_types & (1u64 << UCS_MEMORY_TYPE_CUDA) != 0
    }

    /// Registers `len` bytes at `address` (host or CUDA memory).
    ///
    /// # Safety
    /// The range must stay allocated until [`Ucp::unmap`] is called on the handle.
    pub(super) unsafe fn map(
        &self,
        address: u64,
        len: usize,
        cuda: bool,
    ) -> Result<ucp_mem_h, TransferError> {
        let params = ucp_mem_map_params_t {
            field_mask: u64::from(
                UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            ),
            address: address as *mut c_void,
            length: len,
            memory_type: if cuda {
                UCS_MEMORY_TYPE_CUDA
            } else {
                UCS_MEMORY_TYPE_HOST
            },
            ..Default::default()
        };
        let mut memh: ucp_mem_h = std::ptr::null_mut();
        // SAFETY: the caller keeps the range allocated while it is mapped.
        self.lib.check("mem map", unsafe {
            self.lib.ucp_mem_map(self.context, &params, &mut memh)
        })?;
        Ok(memh)
    }

    /// Allocates and registers `len` bytes of host memory (shared memory where UCX has it);
    /// returns the handle and the address.
    pub(super) fn alloc(&self, len: usize) -> Result<(ucp_mem_h, u64), TransferError> {
        let params = ucp_mem_map_params_t {
            field_mask: u64::from(
                UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            ),
            address: std::ptr::null_mut(),
            length: len,
            flags: UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut memh: ucp_mem_h = std::ptr::null_mut();
        // SAFETY: UCX allocates and maps `len` bytes; `memh` receives the handle.
        self.lib.check("mem map (allocate)", unsafe {
            self.lib.ucp_mem_map(self.context, &params, &mut memh)
        })?;
        let mut attr = ucp_mem_attr_t {
            field_mask: u64::from(UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: `memh` is live; `attr` is a valid out-parameter.
        let queried = self.lib.check("mem query", unsafe {
            self.lib.ucp_mem_query(memh, &mut attr)
        });
        let usable = queried.and_then(|()| {
            if attr.address.is_null() || attr.length < len {
                Err(TransferError::Ucx {
                    op: "mem map (allocate)",
                    detail: format!("got {} bytes at {:p}", attr.length, attr.address),
                })
            } else {
                Ok(())
            }
        });
        if let Err(e) = usable {
            self.unmap(memh);
            return Err(e);
        }
        Ok((memh, attr.address as u64))
    }

    /// Unregisters (and, for [`Ucp::alloc`] memory, frees) a handle, once.
    pub(super) fn unmap(&self, memh: ucp_mem_h) {
        // SAFETY: every caller passes a handle from `map`/`alloc` on this context exactly once.
        let status = unsafe { self.lib.ucp_mem_unmap(self.context, memh) };
        if status != UCS_OK {
            let error = self.lib.status_string(status);
            tracing::warn!(%error, "kv transfer: ucp_mem_unmap failed");
        }
    }

    /// The packed remote key of a registered range.
    pub(super) fn pack(&self, memh: ucp_mem_h) -> Result<Vec<u8>, TransferError> {
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: `memh` is live; UCX allocates `buf`, released after the copy.
        self.lib.check("rkey pack", unsafe {
            self.lib
                .ucp_rkey_pack(self.context, memh, &mut buf, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `buf`.
        let rkey = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
        // SAFETY: `buf` came from `ucp_rkey_pack`.
        unsafe { self.lib.ucp_rkey_buffer_release(buf) };
        Ok(rkey)
    }

    /// A local address through which `len` bytes of remote memory at `base` can be written
    /// directly (same-host shared memory), when UCX can give one for the whole range.
    pub(super) fn rkey_ptr(&self, rkey: ucp_rkey_h, base: u64, len: u64) -> Option<u64> {
        let mut first: *mut c_void = std::ptr::null_mut();
        let mut last: *mut c_void = std::ptr::null_mut();
        // SAFETY: `rkey` is a live unpacked key; UCX validates the addresses against it.
        let ok = unsafe {
            self.lib.ucp_rkey_ptr(rkey, base, &mut first) == UCS_OK
                && self.lib.ucp_rkey_ptr(rkey, base + len - 1, &mut last) == UCS_OK
        };
        // One contiguous local mapping for the whole range, or nothing.
        (ok && !first.is_null() && (last as u64).wrapping_sub(first as u64) == len - 1)
            .then_some(first as u64)
    }
}

impl Drop for Ucp {
    fn drop(&mut self) {
        // SAFETY: both handles are live and destroyed once, worker first.
        unsafe {
            self.lib.ucp_worker_destroy(self.worker);
            self.lib.ucp_cleanup(self.context);
        }
    }
}

/// Initialises UCX once with `config` and tears it down again; returns UCX's version.
pub(crate) fn probe(config: &UcxConfig) -> Result<String, TransferError> {
    let ucp = Ucp::new(config)?;
    ucp.address()?;
    let lib = ucp.lib;
    drop(ucp);
    // SAFETY: returns a static NUL-terminated string.
    Ok(unsafe { CStr::from_ptr(lib.ucp_get_version_string()) }
        .to_string_lossy()
        .into_owned())
}
