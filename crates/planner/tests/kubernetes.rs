//! The Kubernetes actuator against a stand-in API server (axum on loopback) that serves the
//! `scale` subresource of two Deployments and checks every request as the real one would:
//! the method, the path, the merge-patch content type and the body's shape.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use serde_json::{Value, json};
use tandem_planner::{Actuator, Kubernetes, KubernetesConfig, Pool};

#[derive(Default)]
struct Api {
    /// replicas by Deployment name.
    replicas: HashMap<String, u32>,
    /// Every request: method, path, content type, body.
    seen: Vec<(String, String, String, String)>,
}

type Shared = Arc<Mutex<Api>>;

fn scale_doc(ns: &str, name: &str, n: u32) -> Value {
    // As the API server answers (`autoscaling/v1` Scale); `spec.replicas` omitted at 0.
    let spec = if n == 0 {
        json!({})
    } else {
        json!({ "replicas": n })
    };
    json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": { "name": name, "namespace": ns },
        "spec": spec,
        "status": { "replicas": n, "selector": "app=x" }
    })
}

async fn get_scale(
    State(api): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
) -> (StatusCode, String) {
    let mut api = api.lock();
    let path = format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale");
    api.seen
        .push(("GET".into(), path, String::new(), String::new()));
    match api.replicas.get(&name) {
        Some(&n) => (StatusCode::OK, scale_doc(&ns, &name, n).to_string()),
        None => (
            StatusCode::NOT_FOUND,
            json!({"kind": "Status", "code": 404}).to_string(),
        ),
    }
}

async fn patch_scale(
    State(api): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let mut api = api.lock();
    let ct = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = String::from_utf8_lossy(&body).into_owned();
    let path = format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale");
    api.seen
        .push(("PATCH".into(), path, ct.clone(), text.clone()));
    // The API server refuses a patch type it was not told (415), and a merge patch that does
    // not parse (400).
    if ct != "application/merge-patch+json" {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, String::new());
    }
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return (StatusCode::BAD_REQUEST, String::new());
    };
    let Some(n) = v.pointer("/spec/replicas").and_then(Value::as_u64) else {
        return (StatusCode::UNPROCESSABLE_ENTITY, String::new());
    };
    if !api.replicas.contains_key(&name) {
        return (StatusCode::NOT_FOUND, String::new());
    }
    api.replicas.insert(name.clone(), n as u32);
    (StatusCode::OK, scale_doc(&ns, &name, n as u32).to_string())
}

async fn serve(api: Shared) -> String {
    let app = Router::new()
        .route(
            "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
            get(get_scale).patch(patch_scale),
        )
        .with_state(api);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/")
}

fn actuator(api: String) -> Kubernetes {
    Kubernetes::new(KubernetesConfig {
        api,
        namespace: "llm".into(),
        prefill_deployment: "tandem-prefill".into(),
        decode_deployment: "tandem-decode".into(),
        timeout: Duration::from_secs(5),
    })
    .unwrap()
}

#[tokio::test]
async fn reads_and_patches_the_scale_subresource() {
    let api: Shared = Arc::default();
    api.lock().replicas = HashMap::from([
        ("tandem-prefill".to_string(), 0),
        ("tandem-decode".to_string(), 2),
    ]);
    let mut k = actuator(serve(api.clone()).await);
    assert_eq!(k.replicas(Pool::Prefill).await.unwrap(), 0);
    assert_eq!(k.replicas(Pool::Decode).await.unwrap(), 2);
    k.set(Pool::Prefill, 3).await.unwrap();
    k.set(Pool::Decode, 1).await.unwrap();
    assert_eq!(k.replicas(Pool::Prefill).await.unwrap(), 3);
    assert_eq!(k.replicas(Pool::Decode).await.unwrap(), 1);

    let seen = api.lock().seen.clone();
    let patches: Vec<_> = seen.iter().filter(|s| s.0 == "PATCH").collect();
    assert_eq!(patches.len(), 2);
    assert_eq!(
        patches[0].1,
        "/apis/apps/v1/namespaces/llm/deployments/tandem-prefill/scale"
    );
    assert_eq!(patches[0].2, "application/merge-patch+json");
    assert_eq!(
        serde_json::from_str::<Value>(&patches[0].3).unwrap(),
        json!({"spec": {"replicas": 3}})
    );
    assert_eq!(
        patches[1].1,
        "/apis/apps/v1/namespaces/llm/deployments/tandem-decode/scale"
    );
    assert_eq!(
        serde_json::from_str::<Value>(&patches[1].3).unwrap(),
        json!({"spec": {"replicas": 1}})
    );
    assert_eq!(seen.iter().filter(|s| s.0 == "GET").count(), 4);
    k.shutdown().await.unwrap();
}

#[tokio::test]
async fn api_errors_are_reported_with_their_status() {
    let api: Shared = Arc::default();
    let mut k = actuator(serve(api).await);
    let e = k.replicas(Pool::Decode).await.unwrap_err().to_string();
    assert!(
        e.contains("404") && e.contains("tandem-decode/scale"),
        "{e}"
    );
    let e = k.set(Pool::Decode, 2).await.unwrap_err().to_string();
    assert!(e.contains("PATCH") && e.contains("404"), "{e}");
}
