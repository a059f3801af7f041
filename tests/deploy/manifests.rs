//! The rendered manifests: schemas, KEDA's fields, and the topology's promises.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use super::*;

/// Validates `docs` with kubernetes-validate; panics unless each one passed.
fn validate(label: &str, docs: &[Value], dir: &Path) {
    let file = dir.join(format!("{}.json", label.replace(['/', ' ', '+'], "_")));
    // One JSON document per line is YAML too.
    let text: String = docs.iter().map(|d| format!("---\n{d}\n")).collect();
    std::fs::write(&file, text).unwrap();
    let out = Command::new(crate::common::python("kubernetes"))
        .args([
            "-m",
            "kubernetes_validate",
            "--strict",
            "-k",
            KUBERNETES_VERSION,
        ])
        .arg(&file)
        .output()
        .expect("the kubernetes venv's python3 (scripts/test.sh makes it: kubernetes-validate)");
    let report =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{label}: kubernetes-validate failed:\n{report}"
    );
    for d in docs {
        let id = format!("{}/{}", s(d, "kind").to_lowercase(), name(d));
        assert!(
            report.contains(&format!("passed for resource {id} ")),
            "{label}: {id} was not validated:\n{report}"
        );
    }
}

#[test]
fn strict_validation_rejects_an_unknown_field() {
    // The control for `validate`: a misspelt field must fail it, or a pass means nothing.
    let dir = common::temp_dir("deploy-control");
    let bad = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}},
        "spec": {"terminationGracePeriodSecond": 90, "containers": [{"name": "x", "image": "x"}]}}}});
    let r = std::panic::catch_unwind(|| validate("control", &[bad], &dir));
    assert!(
        r.is_err(),
        "kubernetes-validate --strict accepted an unknown field"
    );
}

#[test]
fn manifests_render_and_validate() {
    let dir = common::temp_dir("deploy-validate");
    let adapter = adapter_rules();
    let scratch = common::temp_dir("deploy-renders-validate");
    for (label, path) in renders(&scratch) {
        let docs = yaml_docs(&kustomize(&path));
        assert!(!docs.is_empty(), "{label} renders nothing");
        let (crds, builtin): (Vec<Value>, Vec<Value>) = docs.iter().cloned().partition(|d| {
            let api = s(d, "apiVersion");
            api.starts_with("keda.sh/") || api.starts_with("inference.networking.k8s.io/")
        });
        let (pools, crds): (Vec<Value>, Vec<Value>) =
            crds.into_iter().partition(|d| d["kind"] == "InferencePool");
        validate(&label, &builtin, &dir);
        for pool in &pools {
            check_inference_pool(&label, pool, &docs);
        }
        let mut keda_hpas = Vec::new();
        for so in &crds {
            assert_eq!(
                so["kind"], "ScaledObject",
                "{label}: unexpected CRD kind in {so}"
            );
            keda_hpas.push(check_scaled_object(&label, so, &docs));
        }
        if !keda_hpas.is_empty() {
            validate(&format!("{label} (KEDA's HPAs)"), &keda_hpas, &dir);
        }
        check_topology(&label, &docs);
        for hpa in of_kind(&docs, "HorizontalPodAutoscaler") {
            let target = s(hpa, "spec.scaleTargetRef.name");
            assert!(
                find(&docs, "Deployment", target).is_some(),
                "{label}: HPA {} scales no Deployment {target}",
                name(hpa)
            );
            for m in at(hpa, "spec.metrics").as_array().unwrap() {
                assert_eq!(
                    m["type"],
                    "External",
                    "{label}: HPA {} scales on {m}: load signals only",
                    name(hpa)
                );
                let metric = s(m, "external.metric.name");
                assert!(
                    adapter.contains_key(metric),
                    "{label}: HPA {} uses {metric}, which adapter-rules.yaml does not define",
                    name(hpa)
                );
            }
        }
    }
}

/// Checks an InferencePool against the fields of GIE's v1 API
/// (`api/v1/inferencepool_types.go`): its selector picks the pods of a Deployment of the
/// render, its target port is a port their engine listens on, and its endpoint picker is a
/// Service of the render whose port it names.
fn check_inference_pool(label: &str, pool: &Value, docs: &[Value]) {
    let n = name(pool);
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    let keys = |v: &Value| -> Vec<String> {
        v.as_object()
            .unwrap_or_else(|| panic!("{label}: InferencePool {n}: {v} is not a map"))
            .keys()
            .cloned()
            .collect()
    };
    for k in keys(&pool["spec"]) {
        assert!(
            ["selector", "targetPorts", "endpointPickerRef"].contains(&k.as_str()),
            "{label}: InferencePool {n}: spec.{k} is not a v1 field"
        );
    }
    let picker = &pool["spec"]["endpointPickerRef"];
    for k in keys(picker) {
        assert!(
            ["group", "kind", "name", "port", "failureMode"].contains(&k.as_str()),
            "{label}: InferencePool {n}: endpointPickerRef.{k} is not a v1 field"
        );
    }
    if let Some(mode) = picker["failureMode"].as_str() {
        assert!(["FailOpen", "FailClose"].contains(&mode), "{label}: {mode}");
    }
    let selector = at(pool, "spec.selector.matchLabels")
        .as_object()
        .unwrap_or_else(|| panic!("{label}: InferencePool {n} has no matchLabels"));
    let selected: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .filter(|d| {
            let labels = &d["spec"]["template"]["metadata"]["labels"];
            selector.iter().all(|(k, v)| &labels[k] == v)
        })
        .collect();
    assert_eq!(
        selected.len(),
        1,
        "{label}: InferencePool {n} should select the pods of one Deployment"
    );
    let pod = &selected[0]["spec"]["template"];
    let ports: Vec<u64> = pod["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["containerPort"].as_u64())
        .collect();
    for t in at(pool, "spec.targetPorts").as_array().unwrap() {
        let port = t["number"].as_u64().unwrap();
        assert!(
            ports.contains(&port),
            "{label}: InferencePool {n} targets port {port}, which its pods ({}) do not open \
             ({ports:?})",
            name(selected[0])
        );
    }
    let svc = s(picker, "name");
    let service = find(docs, "Service", svc)
        .unwrap_or_else(|| panic!("{label}: InferencePool {n}'s picker {svc} is no Service"));
    let port = picker["port"]["number"].as_u64().unwrap();
    assert!(
        service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"].as_u64() == Some(port)),
        "{label}: Service {svc} has no port {port}"
    );
}

/// The prometheus-adapter rules: external metric name → PromQL.
pub(crate) fn adapter_rules() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(deploy().join("prometheus/adapter-rules.yaml")).unwrap();
    let doc = &yaml_docs(&text)[0];
    doc["externalRules"]
        .as_array()
        .expect("externalRules")
        .iter()
        .map(|r| {
            (
                s(r, "name.as").to_string(),
                s(r, "metricsQuery").to_string(),
            )
        })
        .collect()
}

/// Checks a ScaledObject against the fields KEDA documents (ScaledObject specification and
/// the Prometheus scaler, KEDA 2.x) and that it scales a Deployment of the render; returns
/// the HPA KEDA would make from it, for the HPA schema.
fn check_scaled_object(label: &str, so: &Value, docs: &[Value]) -> Value {
    let n = name(so);
    let only = |v: &Value, what: &str, allowed: &[&str]| {
        for k in v
            .as_object()
            .unwrap_or_else(|| panic!("{label}: {n}: {what} is not a map"))
            .keys()
        {
            assert!(
                allowed.contains(&k.as_str()),
                "{label}: ScaledObject {n}: {what}.{k} is not a KEDA field"
            );
        }
    };
    assert_eq!(so["apiVersion"], "keda.sh/v1alpha1");
    let spec = &so["spec"];
    only(
        spec,
        "spec",
        &[
            "scaleTargetRef",
            "pollingInterval",
            "cooldownPeriod",
            "initialCooldownPeriod",
            "idleReplicaCount",
            "minReplicaCount",
            "maxReplicaCount",
            "fallback",
            "advanced",
            "triggers",
        ],
    );
    only(
        &spec["scaleTargetRef"],
        "spec.scaleTargetRef",
        &["apiVersion", "kind", "name", "envSourceContainerName"],
    );
    let kind = spec["scaleTargetRef"]["kind"]
        .as_str()
        .unwrap_or("Deployment");
    let target = s(spec, "scaleTargetRef.name");
    assert!(
        find(docs, kind, target).is_some(),
        "{label}: ScaledObject {n} scales no {kind} {target}"
    );
    let (min, max) = (
        spec["minReplicaCount"].as_u64().unwrap_or(0),
        spec["maxReplicaCount"].as_u64().unwrap_or(100),
    );
    assert!(
        min >= 1 && min <= max,
        "{label}: ScaledObject {n}: replicas {min}..{max}"
    );
    for k in ["pollingInterval", "cooldownPeriod"] {
        assert!(
            spec[k].is_null() || spec[k].is_u64(),
            "{label}: {n}: {k} must be an integer"
        );
    }
    let advanced = &spec["advanced"];
    if !advanced.is_null() {
        only(
            advanced,
            "spec.advanced",
            &[
                "restoreToOriginalReplicaCount",
                "horizontalPodAutoscalerConfig",
                "scalingModifiers",
            ],
        );
        only(
            &advanced["horizontalPodAutoscalerConfig"],
            "spec.advanced.horizontalPodAutoscalerConfig",
            &["name", "behavior"],
        );
    }
    let triggers = spec["triggers"]
        .as_array()
        .unwrap_or_else(|| panic!("{label}: {n} has no triggers"));
    assert!(!triggers.is_empty(), "{label}: {n} has no triggers");
    let mut metrics = Vec::new();
    for t in triggers {
        only(
            t,
            "trigger",
            &[
                "type",
                "name",
                "metadata",
                "metricType",
                "useCachedMetrics",
                "authenticationRef",
            ],
        );
        assert_eq!(
            t["type"], "prometheus",
            "{label}: {n}: triggers are Prometheus queries"
        );
        let md = &t["metadata"];
        only(
            md,
            "trigger.metadata",
            &[
                "serverAddress",
                "query",
                "threshold",
                "activationThreshold",
                "namespace",
                "customHeaders",
                "ignoreNullValues",
                "queryParameters",
                "unsafeSsl",
                "timeout",
            ],
        );
        for (k, v) in md.as_object().unwrap() {
            assert!(
                v.is_string(),
                "{label}: {n}: metadata.{k} must be a string (KEDA's metadata is string to string)"
            );
        }
        for k in ["serverAddress", "query", "threshold"] {
            assert!(
                md[k].is_string(),
                "{label}: {n}: a Prometheus trigger needs metadata.{k}"
            );
        }
        let threshold = s(md, "threshold");
        assert!(
            threshold.parse::<f64>().is_ok_and(|v| v > 0.0),
            "{label}: {n}: threshold {threshold:?}"
        );
        let metric_type = t["metricType"].as_str().unwrap_or("AverageValue");
        let target = match metric_type {
            "Value" => json!({"type": "Value", "value": threshold}),
            "AverageValue" => json!({"type": "AverageValue", "averageValue": threshold}),
            other => panic!("{label}: {n}: metricType {other} (a query result has no utilisation)"),
        };
        metrics.push(json!({"type": "External", "external": {"metric": {"name": format!("s{}-prometheus", metrics.len())}, "target": target}}));
    }
    let mut hpa = json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": format!("keda-hpa-{n}")},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": kind, "name": target},
                 "minReplicas": min, "maxReplicas": max, "metrics": metrics}});
    let behavior = &advanced["horizontalPodAutoscalerConfig"]["behavior"];
    if !behavior.is_null() {
        hpa["spec"]["behavior"] = behavior.clone();
    }
    hpa
}

/// The shape the README promises: grace periods, probes, pools, replica sync.
fn check_topology(label: &str, docs: &[Value]) {
    for (workload, pod) in pods(docs) {
        let spec = &pod["spec"];
        let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        let containers = spec["containers"].as_array().unwrap();
        for c in containers {
            assert!(
                grace > pre_stop_s(c),
                "{label}: {workload}: grace {grace} s does not cover {}'s preStop",
                c["name"]
            );
            if !is_tandem(c) {
                continue;
            }
            let env = environment(docs, c);
            let drain: u64 = env
                .get("TANDEM_DRAIN_TIMEOUT_S")
                .map_or(30, |v| v.parse().unwrap());
            assert!(
                grace > pre_stop_s(c) + drain,
                "{label}: {workload}: grace {grace} s <= preStop + drain {drain} s"
            );
            let engine = env.get("TANDEM_ENGINE").map_or("mocker", String::as_str);
            if engine != "mocker" {
                // A sidecar: its engine must outlive the drain, or requests in flight die.
                let outlives = containers
                    .iter()
                    .any(|e| !is_tandem(e) && pre_stop_s(e) >= drain);
                assert!(
                    outlives,
                    "{label}: {workload}: no engine container stays up through the {drain} s drain"
                );
                assert!(
                    env.contains_key("TANDEM_ENGINE_URL"),
                    "{label}: {workload}: a sidecar needs TANDEM_ENGINE_URL"
                );
            }
        }
    }
    for role in ["prefill", "decode"] {
        let d = find(docs, "Deployment", role)
            .unwrap_or_else(|| panic!("{label}: no {role} Deployment"));
        let containers = at(d, "spec.template.spec.containers").as_array().unwrap();
        let worker = containers
            .iter()
            .find(|c| is_tandem(c))
            .expect("a tandem container");
        assert_eq!(
            worker["args"][0], role,
            "{label}: the {role} Deployment runs `tandem {role}`"
        );
        assert!(
            containers.iter().any(|c| gpus(c) >= 1),
            "{label}: {role} pods request no nvidia.com/gpu"
        );
    }
    let f = find(docs, "Deployment", "frontend")
        .unwrap_or_else(|| panic!("{label}: no frontend Deployment"));
    assert!(
        at(f, "spec.replicas").as_u64().unwrap() >= 2,
        "{label}: frontend replicas"
    );
    let c = &at(f, "spec.template.spec.containers")[0];
    assert_eq!(c["args"][0], "frontend");
    let env = environment(docs, c);
    assert_eq!(
        env.get("TANDEM_REPLICA_SYNC").map(String::as_str),
        Some("true"),
        "{label}: replica sync"
    );
    let port = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "http")
        .expect("port http");
    let listen = &env["TANDEM_LISTEN"];
    assert!(
        listen.ends_with(&format!(":{}", port["containerPort"])),
        "{label}: TANDEM_LISTEN {listen} vs {port}"
    );
    // The operator's surfaces on their own port: scraped there, not in the Service.
    let admin = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "admin")
        .expect("port admin");
    let admin_port = admin["containerPort"].to_string();
    let admin_listen = &env["TANDEM_ADMIN_LISTEN"];
    assert!(
        admin_listen.ends_with(&format!(":{admin_port}")),
        "{label}: TANDEM_ADMIN_LISTEN {admin_listen} vs {admin}"
    );
    assert_eq!(
        at(f, "spec.template.metadata.annotations")["prometheus.io/port"],
        admin_port.as_str(),
        "{label}: the frontend is scraped on its admin port"
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_ne!(c[probe]["httpGet"]["port"], "admin", "{label}: {probe}");
    }
    for (probe, path) in [("readinessProbe", "/health"), ("livenessProbe", "/live")] {
        assert_eq!(
            c[probe]["httpGet"]["path"], path,
            "{label}: frontend {probe}"
        );
        assert_eq!(
            c[probe]["httpGet"]["port"], "http",
            "{label}: frontend {probe} port"
        );
    }
    let labels = at(f, "spec.template.metadata.labels").as_object().unwrap();
    let selects = |sel: &Value| {
        sel.as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    };
    assert!(
        of_kind(docs, "PodDisruptionBudget").any(|p| selects(at(p, "spec.selector.matchLabels"))),
        "{label}: no PDB for the frontend"
    );
    assert!(
        of_kind(docs, "Service").any(|s| selects(&s["spec"]["selector"])),
        "{label}: no Service for the frontend"
    );
    for svc in of_kind(docs, "Service").filter(|s| selects(&s["spec"]["selector"])) {
        let exposed = svc["spec"]["ports"].as_array().unwrap();
        assert!(
            exposed
                .iter()
                .all(|p| p["targetPort"] != "admin" && p["targetPort"] != admin["containerPort"]),
            "{label}: a Service exposes the frontend's admin port"
        );
    }
}
