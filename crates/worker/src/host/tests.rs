use tandem_engine::{BlockPoolConfig, MockEngine, MockEngineConfig, MockerConfig};
use tandem_runtime::events::MemoryEventPlane;

use super::*;

fn host(output_buffer: usize, tasks: &TaskTracker, stop: &CancellationToken) -> EngineHost {
    host_of(
        output_buffer,
        tandem_engine::KvShape::TIMING_ONLY,
        tasks,
        stop,
    )
}

fn host_of(
    output_buffer: usize,
    shape: tandem_engine::KvShape,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> EngineHost {
    let mut cfg = MockEngineConfig::new(BlockPoolConfig::new(WorkerId(1), 64));
    cfg.mocker.kv_shape = shape;
    host_with(output_buffer, cfg, tasks, stop)
}

fn host_with(
    output_buffer: usize,
    cfg: MockEngineConfig,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> EngineHost {
    let publishing = HostPublishing {
        events: Arc::new(MemoryEventPlane::new()),
        kv_subject: "kv".into(),
        metrics: Arc::default(),
    };
    let engine = MockEngine::new(cfg).expect("engine");
    EngineHost::start(
        engine.into_dyn(),
        publishing,
        output_buffer,
        tasks,
        stop.clone(),
    )
}

/// A host whose mocker answers at once: steps of no time, no KV bytes.
fn instant_host(output_buffer: usize, tasks: &TaskTracker, stop: &CancellationToken) -> EngineHost {
    let mut cfg = MockEngineConfig::new(BlockPoolConfig::new(WorkerId(1), 64));
    cfg.mocker.kv_shape = tandem_engine::KvShape::TIMING_ONLY;
    cfg.mocker.speedup_ratio = 1e9;
    host_with(output_buffer, cfg, tasks, stop)
}

fn request(id: u64, max_tokens: u32) -> EngineRequest {
    let mut r = EngineRequest::new(RequestId(id), (0..40).collect(), max_tokens);
    r.ignore_eos = true;
    r
}

/// Steps end at their start plus their modelled duration: a lone request's first token
/// comes after exactly its prefill step, each later one exactly one decode step after the
/// previous (on paused time the host's own work takes none, so any gap is the driver's).
#[tokio::test(start_paused = true)]
async fn steps_take_their_modelled_time_and_no_more() {
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let host = host(64, &tasks, &stop);
    let timing = MockerConfig::default().timing;
    let t0 = tokio::time::Instant::now();
    let mut h = host.submit(request(1, 4)).expect("submitted");
    let mut at = Vec::new();
    let mut ttft = None;
    while let Some(out) = h.next().await {
        let Ok(HostOutput::Token(o)) = out else {
            panic!("{out:?}")
        };
        ttft = ttft.or(o.time_to_first_token_us);
        at.push(t0.elapsed().as_micros() as u64);
    }
    let us = |ms: f64| (ms * 1000.0).round() as u64;
    let prefill = us(timing.prefill_ms(40));
    assert_eq!(ttft, Some(prefill), "the engine's TTFT is the modelled one");
    // Each step's outputs arrive when its timer fires: at its modelled end, rounded up to
    // the timer's millisecond; the rounding never carries over to the next step.
    let ms_up = |us: u64| us.div_ceil(1000) * 1000;
    let mut end = prefill;
    let mut expected = vec![ms_up(end)];
    for i in 1..at.len() {
        // A decode step attends over the prompt and the tokens so far.
        end += us(timing.decode_ms((40 + i) as f64 / (64.0 * 16.0)));
        expected.push(ms_up(end));
    }
    assert_eq!(at, expected);
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

/// A mocker sped up to answer at once computes its steps on the host's own task, and lets
/// the consumer read before its channel could overflow: a consumer with room for only two
/// outputs loses nothing of a long answer.
#[tokio::test]
async fn steps_of_no_time_give_the_consumer_its_turn_between_them() {
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let host = instant_host(2, &tasks, &stop);
    for round in 0..3u64 {
        let mut h = host.submit(request(round + 1, 200)).expect("submitted");
        let mut tokens = 0;
        while let Some(out) = h.next().await {
            assert!(matches!(out, Ok(HostOutput::Token(_))), "{out:?}");
            tokens += 1;
        }
        assert_eq!(tokens, 200, "round {round}");
    }
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

/// Steps of no time are computed `INLINE_STEPS` at a time, not one per turn (a yield after
/// each woke the runtime's idle worker): when the consumer gets its turn, the outputs of the
/// steps since wait for it.
#[tokio::test]
async fn steps_of_no_time_are_computed_several_to_a_turn() {
    use futures::FutureExt;
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let host = instant_host(1024, &tasks, &stop);
    let mut h = host.submit(request(1, 100)).expect("submitted");
    let mut turns = Vec::new();
    while let Some(out) = h.next().await {
        assert!(matches!(out, Ok(HostOutput::Token(_))), "{out:?}");
        // What else is there without waiting: the rest of this turn's steps.
        let mut ready = 1;
        while let Some(Some(out)) = h.next().now_or_never() {
            assert!(matches!(out, Ok(HostOutput::Token(_))), "{out:?}");
            ready += 1;
        }
        turns.push(ready);
    }
    assert_eq!(turns.iter().sum::<u32>(), 100);
    // 16 steps to a turn: 7 turns (one per step before).
    assert!(
        turns.len() <= 8,
        "{} turns for 100 steps: {turns:?}",
        turns.len()
    );
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

/// A consumer that stops reading holds at most `output_buffer` outputs: then its request
/// is aborted, its blocks freed, and its handle says why.
#[tokio::test(start_paused = true)]
async fn a_consumer_that_falls_behind_loses_its_request_not_memory() {
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let host = host(4, &tasks, &stop);
    let mut slow = host.submit(request(1, 500)).expect("submitted");
    let mut fast = host.submit(request(2, 20)).expect("submitted");
    let mut fast_tokens = 0;
    while let Some(out) = fast.next().await {
        assert!(matches!(out, Ok(HostOutput::Token(_))), "{out:?}");
        fast_tokens += 1;
    }
    assert_eq!(fast_tokens, 20, "a consumer that keeps up gets everything");
    assert!(
        host.wait_idle(Duration::from_secs(60)).await,
        "the slow request ended"
    );
    assert_eq!(host.with_engine(|e| e.num_running() + e.num_waiting()), 0);
    let mut buffered = 0;
    let end = loop {
        match slow.next().await {
            Some(Ok(HostOutput::Token(_))) => buffered += 1,
            other => break other,
        }
    };
    assert_eq!(buffered, 4);
    assert!(
        matches!(&end, Some(Err(WorkerError::Overloaded(m))) if m.contains("fell 4 outputs behind")),
        "{end:?}"
    );
    assert!(slow.next().await.is_none());
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

/// An export by reference hears of its step's layers while the step runs (a timed model: at
/// each layer's share of the modelled step), each time more of every block, always before
/// the step's blocks and token; and progress never takes the slots those need, so a consumer
/// that reads nothing until the step is over loses no output.
#[tokio::test(start_paused = true)]
async fn a_steps_layers_are_told_before_its_blocks_and_never_crowd_them_out() {
    let shape = tandem_engine::KvShape {
        num_layers: 8,
        ..tandem_engine::KvShape::MOCKER_DEFAULT
    };
    for (buffer, told) in [(64, 7), (3, 1)] {
        let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
        let host = host_of(buffer, shape, &tasks, &stop);
        let layer = host.bytes_per_block() / 8;
        let mut h = host
            .submit_exporting(request(1, 1), 0, true)
            .expect("submitted");
        // Nothing read until the step is over.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let mut outs = Vec::new();
        while let Some(out) = h.next().await {
            outs.push(out.expect("no output lost"));
        }
        let progress: Vec<usize> = outs
            .iter()
            .filter_map(|o| match o {
                HostOutput::Computed { blocks, bytes } => {
                    assert_eq!(blocks.len(), 3, "the 40-token prompt's blocks");
                    Some(*bytes)
                }
                _ => None,
            })
            .collect();
        assert_eq!(progress.len(), told, "buffer {buffer}: {progress:?}");
        assert_eq!(progress[0], layer, "the first layer");
        assert!(progress.windows(2).all(|w| w[0] < w[1]), "{progress:?}");
        assert!(
            progress.iter().all(|&b| b < 8 * layer),
            "the last layer comes whole"
        );
        let n = outs.len();
        assert!(
            matches!(outs[n - 2], HostOutput::Blocks(_)),
            "{:?}",
            outs[n - 2]
        );
        assert!(
            matches!(outs[n - 1], HostOutput::Token(_)),
            "{:?}",
            outs[n - 1]
        );
        host.release_export(RequestId(1));
        stop.cancel();
        tasks.close();
        tasks.wait().await;
    }
}
