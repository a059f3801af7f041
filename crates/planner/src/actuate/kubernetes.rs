//! Kubernetes mode: each pool is a Deployment, sized through its `scale` subresource
//! (`autoscaling/v1` `Scale`):
//!
//! - read: `GET {api}/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale` → `spec.replicas`;
//! - write: `PATCH` of the same path, `Content-Type: application/merge-patch+json`, body
//!   `{"spec":{"replicas":N}}` (RFC 7386 merge patch, as `kubectl scale` sends its change).
//!
//! API reference: <https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/deployment-v1/>
//! (the `/scale` operations) and `Scale` in `autoscaling/v1`.
//!
//! Plain HTTP only (the workspace's reqwest has no TLS): in a pod, run `kubectl proxy
//! --port=8001` as a sidecar — it authenticates to the API server with the pod's service
//! account and serves the API on `http://127.0.0.1:8001`, the default `--kube-api`. The
//! service account needs a Role in the namespace with `apiGroups: ["apps"]`, `resources:
//! ["deployments/scale"]`, `verbs: ["get", "patch"]` (and a RoleBinding to it). Pods that
//! Kubernetes removes get SIGTERM and `terminationGracePeriodSeconds` to drain: set it above
//! the workers' `--drain-timeout-s`.

use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;

use super::Actuator;
use crate::Pool;
use crate::error::PlannerError;

/// Where the Deployments are.
#[derive(Clone, Debug)]
pub struct KubernetesConfig {
    /// The API's base URL (`http://127.0.0.1:8001` with `kubectl proxy`).
    pub api: String,
    pub namespace: String,
    pub prefill_deployment: String,
    pub decode_deployment: String,
    pub timeout: Duration,
}

/// The Kubernetes actuator.
#[derive(Debug)]
pub struct Kubernetes {
    cfg: KubernetesConfig,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct Scale {
    #[serde(default)]
    spec: ScaleSpec,
}

#[derive(Default, Deserialize)]
struct ScaleSpec {
    /// Omitted by the API server when 0.
    #[serde(default)]
    replicas: u32,
}

impl Kubernetes {
    pub fn new(cfg: KubernetesConfig) -> Result<Self, PlannerError> {
        let http = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .build()
            .map_err(|source| PlannerError::Http {
                method: "build",
                url: cfg.api.clone(),
                source,
            })?;
        Ok(Kubernetes { cfg, http })
    }

    /// The pool's Deployment's scale subresource.
    pub fn scale_url(&self, pool: Pool) -> String {
        let name = match pool {
            Pool::Prefill => &self.cfg.prefill_deployment,
            Pool::Decode => &self.cfg.decode_deployment,
        };
        format!(
            "{}/apis/apps/v1/namespaces/{}/deployments/{}/scale",
            self.cfg.api.trim_end_matches('/'),
            self.cfg.namespace,
            name
        )
    }

    async fn send(
        &self,
        method: &'static str,
        url: String,
        req: reqwest::RequestBuilder,
    ) -> Result<String, PlannerError> {
        let resp = req.send().await.map_err(|source| PlannerError::Http {
            method,
            url: url.clone(),
            source,
        })?;
        let status = resp.status();
        let body = resp.text().await.map_err(|source| PlannerError::Http {
            method,
            url: url.clone(),
            source,
        })?;
        if !status.is_success() {
            return Err(PlannerError::Status {
                method,
                url,
                status: status.as_u16(),
                body: body.chars().take(500).collect(),
            });
        }
        Ok(body)
    }
}

#[async_trait]
impl Actuator for Kubernetes {
    async fn replicas(&mut self, pool: Pool) -> Result<u32, PlannerError> {
        let url = self.scale_url(pool);
        let body = self.send("GET", url.clone(), self.http.get(&url)).await?;
        let scale: Scale = serde_json::from_str(&body).map_err(|e| PlannerError::Status {
            method: "GET",
            url,
            status: 200,
            body: format!("not a Scale: {e}"),
        })?;
        Ok(scale.spec.replicas)
    }

    async fn set(&mut self, pool: Pool, n: u32) -> Result<(), PlannerError> {
        let url = self.scale_url(pool);
        let patch = serde_json::json!({ "spec": { "replicas": n } }).to_string();
        let req = self
            .http
            .patch(&url)
            .header("content-type", "application/merge-patch+json")
            .header("accept", "application/json")
            .body(patch);
        self.send("PATCH", url, req).await?;
        tracing::info!(%pool, replicas = n, "Deployment scaled");
        Ok(())
    }

    async fn shutdown(&mut self) -> Result<(), PlannerError> {
        Ok(())
    }
}
