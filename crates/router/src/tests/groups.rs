//! Backend groups: priority order and spillover, each strategy, the limits, the context
//! pre-check and the cooldown rules, and a config's validation.

use serde_json::json;

use crate::groups::*;

/// `groups` (JSON of `[[model.group]]` tables) for model "m", validated.
fn config(groups: serde_json::Value) -> GroupsConfig {
    serde_json::from_value(json!({"model": [{"name": "m", "group": groups}]})).unwrap()
}

fn endpoint(url: &str) -> serde_json::Value {
    json!({"url": url})
}

/// Two groups of one endpoint each: "primary" then "overflow".
fn two_groups() -> Groups {
    let cfg = config(json!([
        {"name": "primary", "endpoint": [endpoint("http://a/v1")]},
        {"name": "overflow", "endpoint": [endpoint("http://b/v1")]},
    ]));
    Groups::new(cfg, 7).unwrap()
}

fn ask(tried: &[EndpointRef]) -> Ask<'_> {
    Ask {
        model: "m",
        prompt_tokens: 100,
        max_tokens: Some(50),
        from_group: 0,
        tried,
        pool_open: true,
        demoted: false,
    }
}

fn at(group: usize, endpoint: usize) -> EndpointRef {
    EndpointRef {
        model: 0,
        group,
        endpoint,
    }
}

fn failed(status: u16) -> Outcome {
    Outcome::Failed {
        status: Some(status),
        retry_after_ms: None,
    }
}

#[test]
fn the_first_group_takes_every_request_it_can() {
    let mut g = two_groups();
    for t in 0..50 {
        let p = g.pick(&ask(&[]), t).unwrap();
        assert_eq!(
            (p.group, p.endpoint, p.skipped),
            (0, Some(at(0, 0)), vec![])
        );
    }
}

#[test]
fn a_429_cools_the_endpoint_at_once_and_the_next_group_takes_over_until_it_ends() {
    let mut g = two_groups();
    g.started(at(0, 0), 150, 1_000);
    g.finished(at(0, 0), failed(429), 1_000);
    assert_eq!(
        g.cooling_until(at(0, 0), 1_000),
        Some(6_000),
        "5 s by default"
    );
    let p = g.pick(&ask(&[]), 2_000).unwrap();
    assert_eq!(p.endpoint, Some(at(1, 0)));
    assert_eq!(p.skipped, vec![(0, Skip::Unavailable)]);
    let p = g.pick(&ask(&[]), 6_000).unwrap();
    assert_eq!(p.endpoint, Some(at(0, 0)), "back once the cooldown ends");
}

#[test]
fn retry_after_sets_the_cooldown_up_to_its_cap() {
    let mut g = two_groups();
    let out = |ms| Outcome::Failed {
        status: Some(429),
        retry_after_ms: Some(ms),
    };
    g.finished(at(0, 0), out(30_000), 0);
    assert_eq!(g.cooling_until(at(0, 0), 0), Some(30_000));
    g.finished(at(1, 0), out(3_600_000), 0);
    assert_eq!(
        g.cooling_until(at(1, 0), 0),
        Some(300_000),
        "capped at max_seconds"
    );
    match g.pick(&ask(&[]), 1_000) {
        Err(NoRoute::Exhausted {
            skipped,
            retry_after_ms,
        }) => {
            assert_eq!(
                skipped,
                vec![(0, Skip::Unavailable), (1, Skip::Unavailable)]
            );
            assert_eq!(retry_after_ms, Some(29_000), "the first cooldown to end");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn auth_not_found_and_timeout_answers_cool_at_once_a_clients_error_does_not() {
    for (status, cools) in [
        (401, true),
        (404, true),
        (408, true),
        (400, false),
        (422, false),
    ] {
        let mut g = two_groups();
        g.finished(at(0, 0), failed(status), 0);
        assert_eq!(g.cooling_until(at(0, 0), 0).is_some(), cools, "{status}");
    }
}

#[test]
fn more_than_half_failing_over_the_last_minute_cools_it_with_enough_requests() {
    let mut g = two_groups();
    // Two successes and two 500s: too few outcomes for the ratio rule.
    for (t, outcome) in [(0, true), (1, false), (2, true), (3, false)] {
        let o = if outcome {
            Outcome::Ok {
                ttft_ms: Some(10),
                tokens: 1,
            }
        } else {
            failed(500)
        };
        g.finished(at(0, 0), o, t);
    }
    assert_eq!(g.cooling_until(at(0, 0), 4), None);
    // A third failure: 3 of 5 > 50 %.
    g.finished(at(0, 0), failed(503), 4);
    assert_eq!(g.cooling_until(at(0, 0), 4), Some(5_004));
    // A minute later the old outcomes are gone: one failure among few cools nothing.
    g.finished(at(0, 0), failed(500), 70_000);
    assert_eq!(g.cooling_until(at(0, 0), 70_000), None);
}

#[test]
fn cancelled_requests_say_nothing_of_the_endpoint() {
    let mut g = two_groups();
    for t in 0..10 {
        g.started(at(0, 0), 1, t);
        g.finished(at(0, 0), Outcome::Cancelled, t);
    }
    assert_eq!(g.cooling_until(at(0, 0), 10), None);
    assert_eq!(g.in_flight(at(0, 0)), 0);
}

#[test]
fn parallel_rpm_and_tpm_limits_spill_to_the_next_group() {
    let limited = |limits: serde_json::Value| {
        let mut e = endpoint("http://a/v1");
        e.as_object_mut()
            .unwrap()
            .extend(limits.as_object().unwrap().clone());
        Groups::new(
            config(json!([
                {"name": "primary", "endpoint": [e]},
                {"name": "overflow", "endpoint": [endpoint("http://b/v1")]},
            ])),
            1,
        )
        .unwrap()
    };
    // Two in flight at most.
    let mut g = limited(json!({"max_parallel_requests": 2}));
    g.started(at(0, 0), 150, 0);
    g.started(at(0, 0), 150, 0);
    let p = g.pick(&ask(&[]), 0).unwrap();
    assert_eq!((p.group, p.skipped), (1, vec![(0, Skip::OverLimits)]));
    g.finished(
        at(0, 0),
        Outcome::Ok {
            ttft_ms: None,
            tokens: 150,
        },
        1,
    );
    assert_eq!(g.pick(&ask(&[]), 1).unwrap().group, 0);
    // Three requests a minute.
    let mut g = limited(json!({"rpm": 3}));
    for t in 0..3 {
        g.started(at(0, 0), 150, t * 1_000);
    }
    assert_eq!(g.pick(&ask(&[]), 10_000).unwrap().group, 1);
    assert_eq!(
        g.pick(&ask(&[]), 60_001).unwrap().group,
        0,
        "the first has aged out"
    );
    // 400 tokens a minute: two requests of 150 fit, a third does not.
    let mut g = limited(json!({"tpm": 400}));
    g.started(at(0, 0), 150, 0);
    assert_eq!(g.pick(&ask(&[]), 0).unwrap().group, 0);
    g.started(at(0, 0), 150, 0);
    assert_eq!(g.pick(&ask(&[]), 0).unwrap().group, 1);
}

#[test]
fn a_context_too_short_for_the_request_skips_the_endpoint() {
    let mut short = endpoint("http://a/v1");
    short["context_length"] = json!(4096);
    let mut g = Groups::new(
        config(json!([
            {"name": "small", "endpoint": [short]},
            {"name": "large", "endpoint": [endpoint("http://b/v1")]},
        ])),
        1,
    )
    .unwrap();
    let mut long = ask(&[]);
    long.prompt_tokens = 4_000;
    assert_eq!(
        g.pick(&long, 0).unwrap().group,
        0,
        "no max_tokens: 4,000 fit"
    );
    long.max_tokens = Some(200);
    let p = g.pick(&long, 0).unwrap();
    assert_eq!((p.group, p.skipped), (1, vec![(0, Skip::ContextTooShort)]));
}

#[test]
fn a_request_that_failed_in_a_group_asks_again_from_the_next_or_past_what_it_tried() {
    let mut g = two_groups();
    let tried = [at(0, 0)];
    let p = g.pick(&ask(&tried), 0).unwrap();
    assert_eq!((p.group, p.skipped), (1, vec![(0, Skip::Tried)]));
    let mut next = ask(&[]);
    next.from_group = 1;
    assert_eq!(g.pick(&next, 0).unwrap().endpoint, Some(at(1, 0)));
    next.from_group = 2;
    assert!(matches!(
        g.pick(&next, 0),
        Err(NoRoute::Exhausted { skipped, .. }) if skipped.is_empty()
    ));
    let mut other = ask(&[]);
    other.model = "other";
    assert_eq!(
        g.pick(&other, 0),
        Err(NoRoute::UnknownModel("other".into()))
    );
}

#[test]
fn only_the_spillover_conditions_go_on_to_the_next_group() {
    for s in [429, 500, 503] {
        assert!(spills(s, false), "{s}");
    }
    assert!(spills(400, true));
    for s in [400, 401, 403, 404, 422, 502] {
        assert!(!spills(s, false), "{s}");
    }
    assert!(is_context_error(
        r#"{"error":{"code":"context_length_exceeded","message":"..."}}"#
    ));
    assert!(is_context_error(
        "This model's maximum context length is 8192 tokens. However, you requested 9000"
    ));
    assert!(!is_context_error(
        r#"{"error":{"message":"bad temperature"}}"#
    ));
}

#[test]
fn weighted_draws_follow_the_weights_and_repeat_with_the_seed() {
    let draws = |seed| {
        let mut a = endpoint("http://a/v1");
        a["weight"] = json!(3);
        let mut b = endpoint("http://b/v1");
        b["rpm"] = json!(1000); // no weight: its rpm weighs
        let mut c = endpoint("http://c/v1");
        c["weight"] = json!(1000);
        c["max_parallel_requests"] = json!(1);
        let mut g =
            Groups::new(config(json!([{"name": "g", "endpoint": [a, b, c]}])), seed).unwrap();
        g.started(at(0, 2), 1, 0); // c is at its limit: never drawn
        (0..4000)
            .map(|_| g.pick(&ask(&[]), 0).unwrap().endpoint.unwrap().endpoint)
            .collect::<Vec<_>>()
    };
    let d = draws(11);
    assert_eq!(d, draws(11), "the same seed draws the same");
    assert_ne!(d, draws(12));
    let a = d.iter().filter(|&&e| e == 0).count() as f64 / d.len() as f64;
    assert!(!d.contains(&2));
    assert!((a - 3.0 / 1003.0).abs() < 0.01, "share of a: {a}");
}

#[test]
fn least_busy_and_latency_strategies_pick_as_they_say() {
    let group = |strategy: &str| {
        Groups::new(
            config(json!([{"name": "g", "strategy": strategy,
                "endpoint": [endpoint("http://a/v1"), endpoint("http://b/v1"), endpoint("http://c/v1")]}])),
            3,
        )
        .unwrap()
    };
    let mut g = group("least-busy");
    g.started(at(0, 0), 1, 0);
    g.started(at(0, 1), 1, 0);
    g.started(at(0, 1), 1, 0);
    assert_eq!(g.pick(&ask(&[]), 0).unwrap().endpoint, Some(at(0, 2)));
    g.started(at(0, 2), 1, 0);
    g.started(at(0, 2), 1, 0);
    assert_eq!(g.pick(&ask(&[]), 0).unwrap().endpoint, Some(at(0, 0)));

    let mut g = group("latency");
    let ok = |ms| Outcome::Ok {
        ttft_ms: Some(ms),
        tokens: 1,
    };
    g.finished(at(0, 0), ok(300), 0);
    g.finished(at(0, 1), ok(100), 0);
    assert_eq!(
        g.pick(&ask(&[]), 0).unwrap().endpoint,
        Some(at(0, 2)),
        "an endpoint with no sample yet is tried first"
    );
    g.finished(at(0, 2), ok(200), 0);
    assert_eq!(g.pick(&ask(&[]), 0).unwrap().endpoint, Some(at(0, 1)));
    // b slows down: its average moves past c's.
    for _ in 0..5 {
        g.finished(at(0, 1), ok(400), 0);
    }
    assert_eq!(g.pick(&ask(&[]), 0).unwrap().endpoint, Some(at(0, 2)));
}

#[test]
fn the_pool_group_is_taken_while_it_is_open() {
    let mut g = Groups::new(
        config(json!([
            {"name": "own", "pool": true},
            {"name": "hosted", "endpoint": [endpoint("https://api.example/v1")]},
        ])),
        1,
    )
    .unwrap();
    let p = g.pick(&ask(&[]), 0).unwrap();
    assert_eq!((p.group, p.endpoint), (0, None));
    let mut shut = ask(&[]);
    shut.pool_open = false;
    let p = g.pick(&shut, 0).unwrap();
    assert_eq!((p.group, p.skipped), (1, vec![(0, Skip::Unavailable)]));
}

#[test]
fn a_batch_group_takes_demoted_requests_only_and_they_nothing_else() {
    let cfg = config(json!([
        {"name": "primary", "endpoint": [endpoint("http://a/v1")]},
        {"name": "batch", "batch": true, "endpoint": [endpoint("http://batch/v1")]},
        {"name": "overflow", "endpoint": [endpoint("http://b/v1")]},
    ]));
    let mut g = Groups::new(cfg, 7).unwrap();
    let p = g.pick(&ask(&[]), 0).unwrap();
    assert_eq!(p.group, 0);
    // The primary cools down: ordinary requests pass the batch group by, unskipped.
    g.finished(at(0, 0), failed(429), 0);
    let p = g.pick(&ask(&[]), 1).unwrap();
    assert_eq!((p.group, p.skipped), (2, vec![(0, Skip::Unavailable)]));
    let demoted = Ask {
        demoted: true,
        ..ask(&[])
    };
    assert_eq!(g.pick(&demoted, 2).unwrap().endpoint, Some(at(1, 0)));
    // The batch group tried: nothing else takes a demoted request.
    let tried = [at(1, 0)];
    let demoted = Ask {
        demoted: true,
        ..ask(&tried)
    };
    assert!(matches!(
        g.pick(&demoted, 3),
        Err(NoRoute::Exhausted { .. })
    ));
    // A model of batch groups alone is refused.
    let only_batch: GroupsConfig = serde_json::from_value(json!({"model": [{"name": "m",
        "group": [{"name": "b", "batch": true, "endpoint": [endpoint("http://b/v1")]}]}]}))
    .unwrap();
    assert!(matches!(
        only_batch.validate(),
        Err(GroupsConfigError::NoGroup(_))
    ));
}

#[test]
fn budgets_and_costs_are_validated_with_the_file() {
    let file = |extra: serde_json::Value| -> GroupsConfig {
        let mut v = json!({"model": [{"name": "m", "group": [
            {"name": "g", "endpoint": [endpoint("http://a/v1")],
             "cost": {"prompt_per_million": 0.15, "completion_per_million": 0.6}}]}]});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    };
    let ok = file(json!({"budget": [{"per": "tenant", "tokens": 1000, "window_seconds": 3600}]}));
    assert_eq!(ok.validate(), Ok(()));
    let cost = ok.models[0].groups[0].cost.unwrap();
    assert!((cost.of(1_000_000, 2_000_000) - 1.35).abs() < 1e-12);
    let bad = file(json!({"budget": [{"per": "session", "tokens": 0}]}));
    assert!(matches!(
        bad.validate(),
        Err(GroupsConfigError::Budget { index: 0, .. })
    ));
    let mut negative = ok.clone();
    negative.models[0].groups[0].cost = Some(Cost {
        prompt_per_million: -1.0,
        completion_per_million: 0.0,
    });
    assert!(matches!(
        negative.validate(),
        Err(GroupsConfigError::Group { .. })
    ));
    let unknown: Result<GroupsConfig, _> =
        serde_json::from_value(json!({"budget": [{"per": "user", "tokens": 5}]}));
    assert!(unknown.is_err(), "per is tenant, session or task");
}

#[test]
fn a_config_is_refused_whole_with_what_is_wrong() {
    let bad = |v: serde_json::Value| GroupsConfig::validate(&serde_json::from_value(v).unwrap());
    let e = endpoint("http://a/v1");
    let refused = [
        (
            json!({"model": [{"name": "m", "group": [{"name": "g", "endpoint": [e]}]},
                             {"name": "m", "group": [{"name": "g", "endpoint": [e]}]}]}),
            "configured twice",
        ),
        (json!({"model": [{"name": "m", "group": []}]}), "no group"),
        (
            json!({"model": [{"name": "m", "group": [{"name": "g", "endpoint": [e]},
                                                     {"name": "g", "endpoint": [e]}]}]}),
            "named twice",
        ),
        (
            json!({"model": [{"name": "m", "group": [{"name": "g", "pool": true, "endpoint": [e]}]}]}),
            "a pool group has no endpoints",
        ),
        (
            json!({"model": [{"name": "m", "group": [{"name": "g"}]}]}),
            "no endpoint",
        ),
        (
            json!({"model": [{"name": "m", "group": [{"name": "g", "endpoint": [{"url": "a:80"}]}]}]}),
            "http:// or https://",
        ),
        (
            json!({"model": [{"name": "m", "group": [{"name": "g", "endpoint": [{"url": "http://a", "rpm": 0}]}]}]}),
            "must be > 0",
        ),
        (
            json!({"model": [{"name": "m", "group": [{"name": "g", "endpoint": [
                {"url": "http://a", "api_key_env": "K", "api_key_file": "/k"}]}]}]}),
            "choose one",
        ),
        (
            json!({"cooldown": {"failure_ratio": 0.0}, "model": []}),
            "failure_ratio",
        ),
    ];
    for (cfg, says) in refused {
        let err = bad(cfg.clone()).unwrap_err().to_string();
        assert!(err.contains(says), "{cfg}: {err}");
    }
    // Unknown keys are refused when read, not ignored.
    let typo = serde_json::from_value::<GroupsConfig>(
        json!({"model": [{"name": "m", "group": [{"name": "g", "endpoint": [{"url": "http://a", "rmp": 3}]}]}]}),
    );
    assert!(typo.unwrap_err().to_string().contains("rmp"));
}

#[test]
fn an_endpoints_status_shows_its_last_minute_and_its_cooldown() {
    let mut g = two_groups();
    g.started(at(0, 0), 10, 0);
    g.started(at(0, 0), 10, 100);
    g.finished(
        at(0, 0),
        Outcome::Ok {
            ttft_ms: Some(40),
            tokens: 10,
        },
        200,
    );
    g.finished(at(0, 0), failed(429), 300);
    let s = g.endpoint_status(at(0, 0), 1_300);
    assert_eq!(
        s,
        EndpointStatus {
            in_flight: 0,
            cooling_ms: Some(4_000),
            sent_last_minute: 2,
            failed_last_minute: 1,
            ended_last_minute: 2,
            ttft_ewma_ms: Some(40.0),
        }
    );
    let later = g.endpoint_status(at(0, 0), 70_000);
    assert_eq!(
        (
            later.cooling_ms,
            later.sent_last_minute,
            later.ended_last_minute
        ),
        (None, 0, 0)
    );
}

#[test]
fn a_cascade_needs_a_rule_and_its_verifier_must_be_a_model_of_the_file() {
    let file = |cascade: serde_json::Value| -> GroupsConfig {
        serde_json::from_value(json!({
            "model": [
                {"name": "s", "group": [{"name": "g", "endpoint": [endpoint("http://s/v1")]}]},
                {"name": "l", "group": [{"name": "g", "endpoint": [endpoint("http://l/v1")]}]},
            ],
            "cascade": [cascade],
        }))
        .unwrap()
    };
    let base = json!({"name": "c", "small": "s", "large": "l"});
    let why = |extra: serde_json::Value| {
        let mut c = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        file(c).validate().err().map(|e| e.to_string())
    };
    assert!(why(json!({})).unwrap().contains("no rule escalates"));
    assert_eq!(why(json!({"verifier": "l"})), None);
    assert_eq!(why(json!({"min_mean_logprob": -0.5})), None);
    assert!(
        why(json!({"verifier": "judge"}))
            .unwrap()
            .contains("\"judge\" is not a [[model]]")
    );
    assert!(
        why(json!({"verifier": "l", "min_verifier_score": 1.5}))
            .unwrap()
            .contains("min_verifier_score")
    );
}
