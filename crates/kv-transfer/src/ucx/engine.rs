//! The UCP worker thread: the only code that calls UCX (besides `ucp::probe`). It owns the UCP
//! context, worker, endpoints, memory maps and remote keys, executes [`Command`]s sent by the
//! async side, progresses the worker, and sleeps on the worker's event fd when idle.
//!
//! Threading: the worker is created with `UCS_THREAD_MODE_SINGLE` and touched only by this
//! thread; other threads only call `ucp_worker_signal`, which UCX documents as safe from any
//! thread, to wake it. Completion and endpoint-error callbacks run inside
//! `ucp_worker_progress` on this thread and only push `(token, status)` into thread-local
//! queues, drained right after progress.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, TryRecvError};
use std::time::{Duration, Instant};

use super::completion::Completion;
use super::direct::Mapping;
use super::handle::{Command, Connected, PutSource, Reply, Wake, WriterState};
use super::sys::*;
use super::ucp::{Ucp, ptr_is_err, ptr_status, request_param};
use crate::descriptor::MemoryKind;
use crate::error::TransferError;
use crate::region::Region;
use crate::transport::TransportConfig;

/// How long the thread keeps polling after its last activity before it sleeps on the event fd.
const SPIN: Duration = Duration::from_micros(50);
/// Poll timeouts of the sleeping thread: shortly after activity (or with operations in
/// flight), and after [`LONG_IDLE`] without any.
const ACTIVE_POLL_MS: i32 = 1;
const IDLE_POLL_MS: i32 = 20;
const LONG_IDLE: Duration = Duration::from_secs(1);
/// How often deadlines are checked while operations are in flight.
const DEADLINE_SCAN: Duration = Duration::from_millis(1);

thread_local! {
    /// `(token, status)` of requests completed during the current progress call.
    static COMPLETED: RefCell<Vec<(u64, ucs_status_t)>> = const { RefCell::new(Vec::new()) };
    /// `(endpoint id, status)` of endpoints UCX declared failed.
    static EP_FAILED: RefCell<Vec<(u64, ucs_status_t)>> = const { RefCell::new(Vec::new()) };
}

// SAFETY: UCX calls this only inside `ucp_worker_progress` on this thread, for a request issued
// with it; it dereferences nothing (the user data is the request's integer token) and only
// queues `(token, status)`. A panic cannot unwind into UCX: it aborts at the `extern "C"` edge.
unsafe extern "C" fn on_send_done(_request: *mut c_void, status: ucs_status_t, user: *mut c_void) {
    COMPLETED.with(|q| q.borrow_mut().push((user as u64, status)));
}

// SAFETY: as `on_send_done`, for an endpoint created with it: `arg` is the endpoint's integer id,
// never dereferenced; `(id, status)` is queued for `drain_callbacks`.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    EP_FAILED.with(|q| q.borrow_mut().push((arg as u64, status)));
}

struct Mapped {
    memh: ucp_mem_h,
    /// Regions mapped by `expose` are kept alive until unmapped; `None` for memory from
    /// `Alloc`, which the region owns (it sends `Free` when dropped).
    keep: Option<Arc<Region>>,
}

struct Endpoint {
    ep: ucp_ep_h,
    peer: Vec<u8>,
    /// Why the endpoint is dead; set once, then it is closed and forgotten.
    failed: Option<TransferError>,
}

struct Writer {
    ep: u64,
    rkey: ucp_rkey_h,
    state: Arc<WriterState>,
    inflight: usize,
    released: bool,
}

enum Op {
    Put {
        writer: u64,
        _src: PutSource,
        done: Option<Arc<Completion>>,
    },
    Flush {
        writer: u64,
        done: Arc<Completion>,
    },
    Connect(ConnectRequest),
    Close,
}

/// A connect waiting for its endpoint flush.
struct ConnectRequest {
    rkey: Vec<u8>,
    /// Remote address and length of the region.
    remote: (u64, u64),
    state: Arc<WriterState>,
    reply: Reply<Connected>,
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Put { .. } => "ucx put",
            Op::Flush { .. } => "ucx flush",
            Op::Connect(_) => "ucx connect",
            Op::Close => "ucx close",
        }
    }
}

struct Pending {
    op: Op,
    ep: u64,
    request: *mut c_void,
    deadline: Instant,
}

pub(super) struct Engine {
    ucp: Ucp,
    instance: u64,
    efd: i32,
    rx: mpsc::Receiver<Command>,
    wake: Arc<Wake>,
    config: TransportConfig,
    /// Memory from `Alloc`, by key.
    allocs: HashMap<u64, ucp_mem_h>,
    /// Exposed regions, by region id.
    maps: HashMap<u64, Mapped>,
    /// Healthy endpoint per peer worker address (the endpoint cache).
    peers: HashMap<Vec<u8>, u64>,
    eps: HashMap<u64, Endpoint>,
    writers: HashMap<u64, Writer>,
    pending: HashMap<u64, Pending>,
    next_id: u64,
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Before `ucp` (a field) destroys the worker: no signal may reach it afterwards.
        *self.wake.worker.lock() = None;
    }
}

impl Engine {
    pub(super) fn new(
        ucp: Ucp,
        instance: u64,
        efd: i32,
        rx: mpsc::Receiver<Command>,
        wake: Arc<Wake>,
        config: TransportConfig,
    ) -> Engine {
        Engine {
            ucp,
            instance,
            efd,
            rx,
            wake,
            config,
            allocs: HashMap::new(),
            maps: HashMap::new(),
            peers: HashMap::new(),
            eps: HashMap::new(),
            writers: HashMap::new(),
            pending: HashMap::new(),
            next_id: 1,
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(super) fn run(mut self) {
        let mut last_busy = Instant::now();
        let mut last_scan = Instant::now();
        loop {
            let mut busy = false;
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        self.wake.queued.fetch_sub(1, Ordering::SeqCst);
                        self.handle(cmd);
                        busy = true;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return self.shutdown(),
                }
            }
            // SAFETY: the worker is live and only this thread progresses it.
            while unsafe { self.ucp.lib.ucp_worker_progress(self.ucp.worker) } != 0 {
                busy = true;
            }
            busy |= self.drain_callbacks();
            let now = Instant::now();
            if !self.pending.is_empty() && now - last_scan >= DEADLINE_SCAN {
                last_scan = now;
                self.expire(now);
            }
            if busy {
                last_busy = now;
            } else if now - last_busy >= SPIN {
                self.sleep(now - last_busy);
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Sleeps until the worker has events or a command arrives. Arm first, then advertise
    /// sleeping, then re-check the queue: a sender either sees `sleeping` and signals (after
    /// the arm, so the fd fires) or its command is seen by the re-check.
    fn sleep(&mut self, idle: Duration) {
        // SAFETY: the worker is live and owned by this thread.
        let armed = unsafe { self.ucp.lib.ucp_worker_arm(self.ucp.worker) };
        if armed != UCS_OK {
            return; // UCS_ERR_BUSY: events pending; anything else: keep polling.
        }
        self.wake.sleeping.store(true, Ordering::SeqCst);
        if self.wake.queued.load(Ordering::SeqCst) == 0 {
            // Wake-ups through the event fd are not fully reliable (UCX 1.13's shared-memory
            // active messages were measured to miss some, stalling transfers that need this
            // side's progress until the poll timed out), so never sleep long while recently
            // active or with operations in flight.
            let timeout_ms = if self.pending.is_empty() && idle >= LONG_IDLE {
                IDLE_POLL_MS
            } else {
                ACTIVE_POLL_MS
            };
            let mut fd = libc::pollfd {
                fd: self.efd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd; the efd belongs to the live worker.
            unsafe { libc::poll(&mut fd, 1, timeout_ms) };
        }
        self.wake.sleeping.store(false, Ordering::SeqCst);
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Alloc { len, reply } => {
                let r = self.ucp.alloc(len).map(|(memh, address)| {
                    let key = self.id();
                    self.allocs.insert(key, memh);
                    (address, key)
                });
                let _ = reply.send(r);
            }
            Command::Free { key } => {
                if let Some(memh) = self.allocs.remove(&key) {
                    // The region that owned the memory is gone; so is its exposure.
                    self.maps.retain(|_, m| m.memh != memh);
                    self.ucp.unmap(memh);
                }
            }
            Command::Expose { region, reply } => {
                let _ = reply.send(self.expose(region));
            }
            Command::Withdraw { region_id, reply } => {
                let r = match self.maps.remove(&region_id) {
                    Some(m) => {
                        if m.keep.is_some() {
                            self.ucp.unmap(m.memh);
                        }
                        Ok(())
                    }
                    None => Err(TransferError::InvalidArgument(format!(
                        "region {region_id} was not exposed by this transport"
                    ))),
                };
                let _ = reply.send(r);
            }
            Command::Connect {
                peer,
                rkey,
                remote_base,
                remote_len,
                state,
                reply,
            } => {
                let request = ConnectRequest {
                    rkey,
                    remote: (remote_base, remote_len),
                    state,
                    reply,
                };
                self.connect(&peer, request)
            }
            Command::Put {
                writer,
                remote_addr,
                src,
                done,
            } => self.put(writer, remote_addr, src, done),
            Command::Flush { writer, done } => self.flush(writer, done),
            Command::Release { writer } => {
                if let Some(w) = self.writers.get_mut(&writer) {
                    w.released = true;
                }
                self.reap(writer);
            }
        }
    }

    fn expose(&mut self, region: Arc<Region>) -> Result<Vec<u8>, TransferError> {
        let cuda = region.memory_kind() == MemoryKind::Cuda;
        if cuda && !self.ucp.supports_cuda() {
            return Err(TransferError::Unsupported(
                "this UCX build has no CUDA memory support".into(),
            ));
        }
        if self.maps.contains_key(&region.id()) {
            return Err(TransferError::InvalidArgument(format!(
                "region {} is already exposed",
                region.id()
            )));
        }
        if let Some((owner, key)) = region.external_key()
            && owner == self.instance
            && let Some(&memh) = self.allocs.get(&key)
        {
            let rkey = self.ucp.pack(memh)?;
            self.maps.insert(region.id(), Mapped { memh, keep: None });
            return Ok(rkey);
        }
        // SAFETY: the region's allocation stays alive while mapped: the `Arc` is stored with
        // the handle and dropped only after `unmap`.
        let memh = unsafe {
            self.ucp
                .map(region.base_address(), region.len_bytes(), cuda)
        }?;
        match self.ucp.pack(memh) {
            Ok(rkey) => {
                self.maps.insert(
                    region.id(),
                    Mapped {
                        memh,
                        keep: Some(region),
                    },
                );
                Ok(rkey)
            }
            Err(e) => {
                self.ucp.unmap(memh);
                Err(e)
            }
        }
    }

    /// The memory handle covering `region`, when this engine mapped or allocated it.
    fn memh_of(&self, region: &Region) -> ucp_mem_h {
        if let Some(m) = self.maps.get(&region.id()) {
            return m.memh;
        }
        match region.external_key() {
            Some((owner, key)) if owner == self.instance => self
                .allocs
                .get(&key)
                .copied()
                .unwrap_or(std::ptr::null_mut()),
            _ => std::ptr::null_mut(),
        }
    }

    fn connect(&mut self, peer: &[u8], request: ConnectRequest) {
        let ep_id = match self.peers.get(peer) {
            Some(&id) => id,
            None => match self.create_ep(peer) {
                Ok(id) => id,
                Err(e) => {
                    let _ = request.reply.send(Err(e));
                    return;
                }
            },
        };
        // Flush the endpoint before unpacking the key, also when it is cached: this completes
        // wireup for a new endpoint and checks that the peer is alive, so that a dead peer
        // fails the connect (within the connect timeout) rather than the first put, and so
        // that the key is not unpacked against a dead peer's shared memory (UCX 1.13 crashes
        // in `ucp_ep_rkey_unpack`'s clean-up when attaching the segment fails).
        let deadline = Instant::now() + self.config.connect_timeout;
        let lib = self.ucp.lib;
        self.issue(
            ep_id,
            Op::Connect(request),
            deadline,
            0,
            std::ptr::null_mut(),
            |ep, param| {
                // SAFETY: `ep` is live and `param` valid for the call.
                unsafe { lib.ucp_ep_flush_nbx(ep, param) }
            },
        );
    }

    /// After the connect flush: unpacks the key and creates the writer.
    fn connected(
        &mut self,
        ep_id: u64,
        rkey_buf: &[u8],
        (base, len): (u64, u64),
        state: Arc<WriterState>,
    ) -> Result<Connected, TransferError> {
        let ep = self
            .eps
            .get(&ep_id)
            .filter(|e| e.failed.is_none())
            .map(|e| e.ep)
            .ok_or(TransferError::Closed)?;
        let mut rkey: ucp_rkey_h = std::ptr::null_mut();
        let lib = self.ucp.lib;
        // SAFETY: `ep` is live; the buffer holds a packed key (UCX validates its contents).
        lib.check("rkey unpack", unsafe {
            lib.ucp_ep_rkey_unpack(ep, rkey_buf.as_ptr() as *const c_void, &mut rkey)
        })
        .map_err(|e| TransferError::BadDescriptor(e.to_string()))?;
        let writer = self.id();
        let entry = Writer {
            ep: ep_id,
            rkey,
            state,
            inflight: 0,
            released: false,
        };
        self.writers.insert(writer, entry);
        let direct = self.ucp.rkey_ptr(rkey, base, len).map(|base| {
            // SAFETY: UCX mapped the whole remote region at `base` (`rkey_ptr` checked both
            // ends); the mapping lives as long as the writer's remote key, which `reap`
            // destroys only after the writer (owner of this mapping) has been dropped.
            unsafe { Mapping::new(base, len as usize) }
        });
        Ok(Connected { writer, direct })
    }

    fn create_ep(&mut self, peer: &[u8]) -> Result<u64, TransferError> {
        let id = self.id();
        let params = ucp_ep_params_t {
            field_mask: u64::from(
                UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            address: peer.as_ptr() as *const ucp_address_t,
            err_mode: if self.config.ucx.peer_failure_detection {
                UCP_ERR_HANDLING_MODE_PEER
            } else {
                UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: id as *mut c_void,
            },
            ..Default::default()
        };
        let mut ep: ucp_ep_h = std::ptr::null_mut();
        let lib = self.ucp.lib;
        // SAFETY: `peer` holds a worker address (UCX parses and validates it) and outlives the
        // call; `ep` receives the handle.
        lib.check("ep create", unsafe {
            lib.ucp_ep_create(self.ucp.worker, &params, &mut ep)
        })
        .map_err(|e| TransferError::PeerFailed(e.to_string()))?;
        let endpoint = Endpoint {
            ep,
            peer: peer.to_vec(),
            failed: None,
        };
        self.eps.insert(id, endpoint);
        self.peers.insert(peer.to_vec(), id);
        Ok(id)
    }

    /// Issues a non-blocking operation with a completion callback and tracks it until done.
    fn issue(
        &mut self,
        ep_id: u64,
        op: Op,
        deadline: Instant,
        extra_mask: u32,
        memh: ucp_mem_h,
        call: impl FnOnce(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    ) {
        let live = self.eps.get(&ep_id).filter(|e| e.failed.is_none());
        let Some(ep) = live.map(|e| e.ep) else {
            let e = self.ep_error(ep_id, UCS_ERR_CANCELED);
            return self.finish_with(op, ep_id, Some(e));
        };
        let token = self.id();
        let mut param = request_param(token, Some(on_send_done));
        param.op_attr_mask |= extra_mask;
        param.memh = memh;
        if extra_mask & UCP_OP_ATTR_FIELD_MEMORY_TYPE != 0 {
            param.memory_type = UCS_MEMORY_TYPE_CUDA;
        }
        let r = call(ep, &param);
        if r.is_null() {
            self.finish(op, ep_id, UCS_OK);
        } else if ptr_is_err(r) {
            self.finish(op, ep_id, ptr_status(r));
        } else {
            let pending = Pending {
                op,
                ep: ep_id,
                request: r,
                deadline,
            };
            self.pending.insert(token, pending);
        }
    }

    fn put(
        &mut self,
        writer: u64,
        remote_addr: u64,
        src: PutSource,
        done: Option<Arc<Completion>>,
    ) {
        let Some(w) = self.writers.get_mut(&writer) else {
            if let Some(d) = done {
                d.complete(Err(TransferError::Closed));
            }
            return;
        };
        if let Some(e) = w.state.error() {
            if let Some(d) = done {
                d.complete(Err(e));
            }
            return;
        }
        w.inflight += 1;
        let (ep_id, rkey) = (w.ep, w.rkey);
        let (ptr, len, cuda, memh) = match &src {
            PutSource::Borrowed(b) | PutSource::Owned { buf: b, .. } => {
                (b.ptr, b.len, false, std::ptr::null_mut())
            }
            PutSource::Run { leases, .. } => {
                let Some(first) = leases.first() else {
                    w.inflight -= 1;
                    let _ = done.map(|d| d.complete(Ok(())));
                    return;
                };
                // Consecutive blocks of `region` (`UcxWriter::put_region`): one range.
                let (region, address) = (first.region(), first.address() as *const u8);
                let cuda = region.memory_kind() == MemoryKind::Cuda;
                let len = region.bytes_per_block() * leases.len();
                (address, len, cuda, self.memh_of(region))
            }
        };
        let mut mask = 0;
        if cuda {
            mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        }
        if !memh.is_null() {
            mask |= UCP_OP_ATTR_FIELD_MEMH;
        }
        let deadline = Instant::now() + self.config.op_timeout;
        let op = Op::Put {
            writer,
            _src: src,
            done,
        };
        let lib = self.ucp.lib;
        self.issue(ep_id, op, deadline, mask, memh, |ep, param| {
            // SAFETY: `ep` and `rkey` are live (a writer's key is destroyed only when it has no
            // put in flight); the source stays valid until completion (borrowed: the owner waits;
            // leased: the lease travels with the pending op); the remote range was bounds-checked
            // against the descriptor by the async side.
            unsafe { lib.ucp_put_nbx(ep, ptr as *const c_void, len, remote_addr, rkey, param) }
        });
    }

    fn flush(&mut self, writer: u64, done: Arc<Completion>) {
        let Some(w) = self.writers.get(&writer) else {
            done.complete(Err(TransferError::Closed));
            return;
        };
        if let Some(e) = w.state.error() {
            done.complete(Err(e));
            return;
        }
        let ep_id = w.ep;
        let deadline = Instant::now() + self.config.op_timeout;
        let op = Op::Flush { writer, done };
        let lib = self.ucp.lib;
        self.issue(ep_id, op, deadline, 0, std::ptr::null_mut(), |ep, param| {
            // SAFETY: `ep` is live and `param` valid for the call.
            unsafe { lib.ucp_ep_flush_nbx(ep, param) }
        });
    }

    /// Handles the outcome of an operation.
    fn finish(&mut self, op: Op, ep_id: u64, status: ucs_status_t) {
        let error = (status != UCS_OK).then(|| self.ep_error(ep_id, status));
        self.finish_with(op, ep_id, error);
        if status != UCS_OK && status != UCS_ERR_CANCELED {
            self.fail_ep(ep_id, status);
        }
    }

    fn finish_with(&mut self, op: Op, ep_id: u64, error: Option<TransferError>) {
        match op {
            Op::Put { writer, done, .. } => {
                if let Some(w) = self.writers.get_mut(&writer) {
                    w.inflight -= 1;
                    if let Some(e) = &error {
                        w.state.fail(e.clone());
                    }
                }
                if let Some(d) = done {
                    d.complete(error.map_or(Ok(()), Err));
                }
                self.reap(writer);
            }
            Op::Flush { writer, done } => {
                let earlier = self.writers.get(&writer).and_then(|w| w.state.error());
                done.complete(match (earlier, error) {
                    (Some(e), _) | (None, Some(e)) => Err(e),
                    (None, None) => Ok(()),
                });
            }
            Op::Connect(request) => match error {
                None => {
                    let ConnectRequest {
                        rkey,
                        remote,
                        state,
                        reply,
                    } = request;
                    let _ = reply.send(self.connected(ep_id, &rkey, remote, state));
                }
                Some(e) => {
                    let _ = request.reply.send(Err(e));
                }
            },
            Op::Close => {
                self.eps.remove(&ep_id);
            }
        }
    }

    fn ep_error(&self, ep_id: u64, status: ucs_status_t) -> TransferError {
        match self.eps.get(&ep_id).and_then(|e| e.failed.clone()) {
            Some(e) => e,
            None => TransferError::PeerFailed(self.ucp.lib.status_string(status)),
        }
    }

    /// Destroys a released writer's key once nothing of it is in flight.
    fn reap(&mut self, writer: u64) {
        let done = self
            .writers
            .get(&writer)
            .is_some_and(|w| w.released && w.inflight == 0);
        if let Some(w) = done.then(|| self.writers.remove(&writer)).flatten()
            && !w.rkey.is_null()
        {
            // SAFETY: unpacked in `connect`, destroyed once; no put in flight uses it, and the
            // writer that might use its direct mapping has been dropped (it sent `Release`).
            unsafe { self.ucp.lib.ucp_rkey_destroy(w.rkey) };
        }
    }

    fn drain_callbacks(&mut self) -> bool {
        let failed = EP_FAILED.with(|q| std::mem::take(&mut *q.borrow_mut()));
        let completed = COMPLETED.with(|q| std::mem::take(&mut *q.borrow_mut()));
        let any = !failed.is_empty() || !completed.is_empty();
        for (ep, status) in failed {
            self.fail_ep(ep, status);
        }
        for (token, status) in completed {
            if let Some(p) = self.pending.remove(&token) {
                // SAFETY: `request` came from an nbx call and is freed once, after completion.
                unsafe { self.ucp.lib.ucp_request_free(p.request) };
                self.finish(p.op, p.ep, status);
            }
        }
        any
    }

    /// Operations past their deadline fail their endpoint, which cancels what is in flight.
    fn expire(&mut self, now: Instant) {
        let late: Vec<(u64, &'static str)> = self
            .pending
            .values()
            .filter(|p| p.deadline <= now && !matches!(p.op, Op::Close))
            .map(|p| (p.ep, p.op.name()))
            .collect();
        for (ep, op) in late {
            let after = if op == "ucx connect" {
                self.config.connect_timeout
            } else {
                self.config.op_timeout
            };
            self.fail_ep_with(ep, TransferError::Timeout { op, after });
        }
    }

    fn fail_ep(&mut self, ep_id: u64, status: ucs_status_t) {
        let e = TransferError::PeerFailed(self.ucp.lib.status_string(status));
        self.fail_ep_with(ep_id, e);
    }

    /// Marks an endpoint dead, fails its writers, forgets it for new connects, and
    /// force-closes it: UCX then completes everything in flight on it with an error.
    fn fail_ep_with(&mut self, ep_id: u64, error: TransferError) {
        let Some(ep) = self.eps.get_mut(&ep_id) else {
            return;
        };
        if ep.failed.is_some() {
            return;
        }
        tracing::debug!(ep = ep_id, %error, "kv transfer: ucx endpoint failed");
        ep.failed = Some(error.clone());
        let (handle, peer) = (ep.ep, ep.peer.clone());
        if self.peers.get(&peer) == Some(&ep_id) {
            self.peers.remove(&peer);
        }
        for w in self.writers.values().filter(|w| w.ep == ep_id) {
            w.state.fail(error.clone());
        }
        self.close_ep(ep_id, handle);
    }

    fn close_ep(&mut self, ep_id: u64, handle: ucp_ep_h) {
        let token = self.id();
        let mut param = request_param(token, Some(on_send_done));
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: `handle` is a live endpoint closed once (it is marked failed first, and
        // failed endpoints are never closed again).
        let r = unsafe { self.ucp.lib.ucp_ep_close_nbx(handle, &param) };
        if r.is_null() || ptr_is_err(r) {
            self.eps.remove(&ep_id);
        } else {
            let pending = Pending {
                op: Op::Close,
                ep: ep_id,
                request: r,
                deadline: Instant::now() + Duration::from_secs(3600),
            };
            self.pending.insert(token, pending);
        }
    }

    fn shutdown(mut self) {
        let ids: Vec<u64> = self.eps.keys().copied().collect();
        for id in ids {
            self.fail_ep_with(id, TransferError::Closed);
        }
        let until = Instant::now() + Duration::from_secs(2);
        while !self.pending.is_empty() && Instant::now() < until {
            // SAFETY: the worker is live and owned by this thread.
            unsafe { self.ucp.lib.ucp_worker_progress(self.ucp.worker) };
            self.drain_callbacks();
        }
        for (_, p) in self.pending.drain() {
            // Requests that never completed are abandoned with the worker; owners waiting
            // on them learn that the transport closed.
            match p.op {
                Op::Put { done: Some(d), .. } | Op::Flush { done: d, .. } => {
                    d.complete(Err(TransferError::Closed))
                }
                Op::Connect(request) => {
                    let _ = request.reply.send(Err(TransferError::Closed));
                }
                _ => {}
            }
        }
        for (_, w) in self.writers.drain() {
            if !w.rkey.is_null() {
                // SAFETY: unpacked in `connect`, destroyed once.
                unsafe { self.ucp.lib.ucp_rkey_destroy(w.rkey) };
            }
        }
        for (_, m) in self.maps.drain() {
            if let Some(region) = m.keep {
                self.ucp.unmap(m.memh);
                drop(region);
            }
        }
        // Every region made from an allocation holds the engine's handle, so none is left
        // here in practice; free whatever is anyway.
        for (_, memh) in self.allocs.drain() {
            self.ucp.unmap(memh);
        }
        // `self.ucp` drops after `Engine::drop`: worker destroyed, context cleaned up.
    }
}
