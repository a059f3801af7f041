//! deploy/: the Kubernetes manifests, the container build and the local rehearsal.
//!
//! - Every kustomization (the base, each overlay, the base with each component) renders with
//!   `kubectl kustomize`, and every resource it renders validates against the Kubernetes
//!   schemas with `kubernetes-validate --strict` (PyPI; offline, schemas bundled).
//!   KEDA's ScaledObject has no schema there: each is checked against the fields KEDA
//!   documents, and the HPA KEDA would make from it is validated as an HPA.
//! - The manifests keep the promises deploy/README.md makes: grace periods that cover the
//!   drains, frontend probes on `/health` and `/live`, GPU requests on the pools, autoscaling
//!   on load signals through PromQL over tandem's metric names only.
//! - Every `--flag` and `TANDEM_*` variable the manifests, env files and deploy/local use is
//!   one that `tandem <role> --help` documents.
//! - deploy/container/build.sh lays out a self-contained image root (the binary runs in it
//!   under chroot), and buildah builds the Containerfile's final stage from it offline.
//! - deploy/local/run.sh starts the topology as processes; each frontend answers a chat
//!   completion, and SIGTERM stops every process.

use tandem_test_support as common;
mod container;
mod flags;
mod local;
mod manifests;
mod promql;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

/// The Kubernetes version the manifests are validated for (one kubernetes-validate bundles).
pub(crate) const KUBERNETES_VERSION: &str = "1.33.0";
pub(crate) const TANDEM_IMAGE: &str = "ghcr.io/tandem-llm/tandem";
pub(crate) const ROLES: [&str; 5] = ["frontend", "prefill", "decode", "indexer", "epp"];

pub(crate) fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub(crate) fn deploy() -> PathBuf {
    repo().join("deploy")
}

/// Runs `cmd`, panicking with its output unless it succeeds; its stdout.
pub(crate) fn output(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("{what}: cannot start {cmd:?} ({e}); scripts/test.sh installs it")
    });
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Multi-document YAML as JSON values (PyYAML, which kubernetes-validate installs), nulls
/// (empty documents) dropped.
pub(crate) fn yaml_docs(yaml: &str) -> Vec<Value> {
    let mut child = Command::new(common::python("kubernetes"))
        .args([
            "-c",
            "import json, sys, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d is not None], sys.stdout)",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the kubernetes venv's python3 (scripts/test.sh makes it)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "YAML does not parse: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

pub(crate) fn s<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path} is not a string in {v}"))
}

/// `v` at a dotted path (`spec.template.spec`); Null where absent.
pub(crate) fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(v, |v, k| &v[k])
}

pub(crate) fn name(doc: &Value) -> &str {
    s(doc, "metadata.name")
}

pub(crate) fn of_kind<'a>(
    docs: &'a [Value],
    kind: &'a str,
) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |d| d["kind"] == kind)
}

pub(crate) fn find<'a>(docs: &'a [Value], kind: &str, n: &str) -> Option<&'a Value> {
    docs.iter().find(|d| d["kind"] == kind && name(d) == n)
}

/// What a test renders: a label and the kustomization's directory (the components' under
/// `scratch`, which the test keeps while it renders).
pub(crate) fn renders(scratch: &Path) -> Vec<(String, PathBuf)> {
    let mut out = vec![("base".to_string(), deploy().join("base"))];
    for o in ["small", "large"] {
        out.push((format!("overlays/{o}"), deploy().join("overlays").join(o)));
    }
    // Each component on top of the base, from a copy of deploy/ with one more kustomization
    // (kustomize refuses absolute paths and roots outside the kustomization's tree).
    let copy = scratch.join("deploy");
    output(
        Command::new("cp").arg("-r").arg(deploy()).arg(&copy),
        "copying deploy/",
    );
    for entry in std::fs::read_dir(deploy().join("components")).unwrap() {
        let component = entry.unwrap().file_name().into_string().unwrap();
        let dir = copy.join(format!("with-{component}"));
        std::fs::create_dir_all(&dir).unwrap();
        // The endpoint picker needs the vLLM pods: only their sidecars register an HTTP
        // endpoint a gateway can send to (components/epp/kustomization.yaml).
        let needs = if component == "epp" {
            "../components/vllm, "
        } else {
            ""
        };
        std::fs::write(
            dir.join("kustomization.yaml"),
            format!("resources: [../base]\ncomponents: [{needs}../components/{component}]\n"),
        )
        .unwrap();
        out.push((format!("base + components/{component}"), dir));
    }
    out
}

pub(crate) fn kustomize(dir: &Path) -> String {
    output(
        Command::new("kubectl").arg("kustomize").arg(dir),
        &format!("kubectl kustomize {}", dir.display()),
    )
}

/// The pod templates of the render's Deployments and StatefulSets, by workload name.
pub(crate) fn pods(docs: &[Value]) -> Vec<(&str, &Value)> {
    docs.iter()
        .filter(|d| d["kind"] == "Deployment" || d["kind"] == "StatefulSet")
        .map(|d| (name(d), at(d, "spec.template")))
        .collect()
}

pub(crate) fn is_tandem(container: &Value) -> bool {
    container["image"]
        .as_str()
        .is_some_and(|i| i.starts_with(TANDEM_IMAGE))
}

/// A container's environment: its ConfigMaps (envFrom, in order) overridden by its `env`
/// (a variable taken from a field or a secret counts, with an empty value).
pub(crate) fn environment(docs: &[Value], c: &Value) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for from in c["envFrom"].as_array().into_iter().flatten() {
        let cm = s(from, "configMapRef.name");
        let cm = find(docs, "ConfigMap", cm)
            .unwrap_or_else(|| panic!("envFrom names a ConfigMap {cm} the render lacks"));
        for (k, v) in cm["data"].as_object().unwrap() {
            env.insert(k.clone(), v.as_str().unwrap().to_string());
        }
    }
    for e in c["env"].as_array().into_iter().flatten() {
        env.insert(
            s(e, "name").to_string(),
            e["value"].as_str().unwrap_or("").to_string(),
        );
    }
    env
}

pub(crate) fn pre_stop_s(c: &Value) -> u64 {
    let pre = &c["lifecycle"]["preStop"];
    assert!(
        pre.is_null() || !pre["sleep"].is_null(),
        "preStop of {} should be a sleep: {pre}",
        c["name"]
    );
    pre["sleep"]["seconds"].as_u64().unwrap_or(0)
}

pub(crate) fn gpus(c: &Value) -> u64 {
    ["requests", "limits"]
        .iter()
        .filter_map(|k| c["resources"][k]["nvidia.com/gpu"].as_u64())
        .max()
        .unwrap_or(0)
}
