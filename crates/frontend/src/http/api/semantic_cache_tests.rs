//! The cache's store: hits within the threshold, partitions that never meet, expiry, the
//! bound on entries, and rebuilds that keep what is live.

use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;

use super::*;

fn cache(config: SemanticCacheConfig) -> SemanticCache {
    SemanticCache::new(
        SemanticCacheConfig {
            enabled: true,
            ..config
        },
        &mut Registry::default(),
    )
}

/// A unit vector at `angle` radians in the plane of the first two axes (8 dimensions).
fn at(angle: f32) -> Vec<f32> {
    let mut v = vec![0.0; 8];
    v[0] = angle.cos();
    v[1] = angle.sin();
    v
}

fn answer(token: u32) -> CachedAnswer {
    CachedAnswer {
        tokens: vec![token],
        finish: FinishReason::Stop,
    }
}

fn key(partition: &str, v: Vec<f32>) -> StoreKey {
    StoreKey {
        partition: partition.into(),
        embedding: v,
    }
}

fn hit(c: &SemanticCache, partition: &str, v: Vec<f32>, now: Instant) -> Option<(u32, f32)> {
    match c.find(partition.into(), v, now) {
        Lookup::Hit(a, d) => Some((a.tokens[0], d)),
        Lookup::Miss(_) | Lookup::Skip => None,
    }
}

#[test]
fn a_near_vector_hits_within_the_threshold_and_a_far_one_misses() {
    let c = cache(SemanticCacheConfig::default());
    let t0 = Instant::now();
    assert_eq!(hit(&c, "a", at(0.0), t0), None, "empty");
    c.store(key("a", at(0.0)), answer(1), t0);
    c.store(key("a", at(1.5)), answer(2), t0);
    // cos(0.2) = 0.980: distance 0.020 ≤ 0.05.
    let (token, d) = hit(&c, "a", at(0.2), t0).unwrap();
    assert_eq!(token, 1);
    assert!((d - (1.0 - 0.2f32.cos())).abs() < 1e-4, "{d}");
    assert_eq!(hit(&c, "a", at(1.45), t0).unwrap().0, 2);
    // cos(0.4) = 0.921: distance 0.079 > 0.05.
    assert_eq!(hit(&c, "a", at(0.4), t0), None);
    assert_eq!(c.len(), 2);
}

#[test]
fn partitions_never_answer_each_other() {
    let c = cache(SemanticCacheConfig::default());
    let t0 = Instant::now();
    c.store(key("tenant-a\0m", at(0.0)), answer(1), t0);
    assert_eq!(hit(&c, "tenant-b\0m", at(0.0), t0), None);
    assert_eq!(hit(&c, "tenant-a\0m", at(0.0), t0).unwrap().0, 1);
    // Another model's embeddings (other dimensions) in the same partition: a miss.
    assert_eq!(hit(&c, "tenant-a\0m", vec![1.0; 4], t0), None);
}

#[test]
fn entries_expire_after_the_ttl_and_the_oldest_go_beyond_the_bound() {
    let c = cache(SemanticCacheConfig {
        ttl: Duration::from_secs(10),
        max_entries: 3,
        ..SemanticCacheConfig::default()
    });
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    for i in 0..3u32 {
        c.store(key("a", at(i as f32)), answer(i), t0 + s * i);
    }
    assert_eq!(c.len(), 3);
    // A fourth pushes out the oldest.
    c.store(key("a", at(3.0)), answer(3), t0 + s * 3);
    assert_eq!(c.len(), 3);
    assert_eq!(hit(&c, "a", at(0.0), t0 + s * 3), None);
    assert_eq!(hit(&c, "a", at(1.0), t0 + s * 3).unwrap().0, 1);
    // Ten seconds after its store, each leaves.
    assert_eq!(hit(&c, "a", at(1.0), t0 + s * 11), None);
    assert_eq!(hit(&c, "a", at(3.0), t0 + s * 11).unwrap().0, 3);
    assert_eq!(hit(&c, "a", at(3.0), t0 + s * 14), None);
    assert!(c.is_empty());
}

#[test]
fn a_thinned_partition_is_rebuilt_with_its_live_entries_only() {
    let c = cache(SemanticCacheConfig {
        ttl: Duration::from_secs(100),
        max_entries: 10,
        ..SemanticCacheConfig::default()
    });
    let t0 = Instant::now();
    let ms = Duration::from_millis(1);
    // 200 answers at distinct angles; the bound keeps the last 10, and the partition is
    // rebuilt as the dead ones pile up.
    let angle = |i: u32| i as f32 * 0.01;
    for i in 0..200u32 {
        c.store(key("a", at(angle(i))), answer(i), t0 + ms * i);
    }
    assert_eq!(c.len(), 10);
    let now = t0 + ms * 200;
    {
        let inner = c.inner.lock();
        let p = &inner.partitions["a"];
        assert_eq!(p.live, 10);
        assert!(p.entries.len() <= 2 * 10 + 64 + 1, "{}", p.entries.len());
    }
    for i in 190..200 {
        assert_eq!(hit(&c, "a", at(angle(i)), now).map(|h| h.0), Some(i));
    }
    // An angle near an evicted one finds the nearest live answer or nothing, never a dead
    // one.
    if let Some((token, _)) = hit(&c, "a", at(angle(10)), now) {
        assert!(token >= 190, "{token}");
    }
    // And the live ones still leave in order, by time, after the rebuild renumbered them.
    let later = t0 + Duration::from_secs(100) + ms * 195;
    let (token, _) = hit(&c, "a", at(angle(194)), later).unwrap();
    assert_eq!(token, 196, "the nearest answer still live");
    assert_eq!(hit(&c, "a", at(angle(199)), later).map(|h| h.0), Some(199));
    assert_eq!(c.len(), 4);
}

#[test]
fn bad_knobs_are_refused() {
    let bad = |c: SemanticCacheConfig| c.validate().unwrap_err();
    let d = SemanticCacheConfig::default();
    assert_eq!(
        bad(SemanticCacheConfig {
            threshold: -0.1,
            ..d.clone()
        }),
        SemanticCacheError::Threshold(-0.1)
    );
    assert!(matches!(
        bad(SemanticCacheConfig {
            threshold: f32::NAN,
            ..d.clone()
        }),
        SemanticCacheError::Threshold(_)
    ));
    assert_eq!(
        bad(SemanticCacheConfig {
            max_entries: 0,
            ..d.clone()
        }),
        SemanticCacheError::MaxEntries
    );
    assert_eq!(
        bad(SemanticCacheConfig {
            last_messages: 0,
            ..d.clone()
        }),
        SemanticCacheError::Messages
    );
    for url in ["not a url", "ftp://host/v1/embeddings"] {
        assert!(matches!(
            bad(SemanticCacheConfig {
                embeddings_url: Some(url.into()),
                ..d.clone()
            }),
            SemanticCacheError::Url(..)
        ));
    }
    let key = SemanticCacheConfig {
        embeddings_url: Some("http://127.0.0.1:1/v1/embeddings".into()),
        embeddings_key: Some(ApiKey("bad\nkey".into())),
        ..d
    };
    assert!(matches!(bad(key.clone()), SemanticCacheError::Url(..)));
    assert!(
        !format!("{key:?}").contains("bad"),
        "the key is never printed"
    );
}
