//! [`ServeError`]: every failure the HTTP edge reports, and the one place that maps it to an
//! HTTP status and OpenAI's error JSON (docs/CONVENTIONS.md §3, 4).
//!
//! | kind              | status | `type`                  | `code` (default)          |
//! |-------------------|--------|-------------------------|---------------------------|
//! | `InvalidRequest`  | 400    | `invalid_request_error` | per case, else `null`     |
//! | `Unauthorized`    | 401    | `invalid_request_error` | `invalid_api_key`         |
//! | `RequestTimeout`  | 408    | `invalid_request_error` | `request_timeout`         |
//! | `ModelNotFound`   | 404    | `invalid_request_error` | `model_not_found`         |
//! | `NotFound`        | 404    | `invalid_request_error` | `not_found`               |
//! | `MethodNotAllowed`| 405    | `invalid_request_error` | `method_not_allowed`      |
//! | `PayloadTooLarge` | 413    | `invalid_request_error` | `request_too_large`       |
//! | `Unprocessable`   | 422    | `invalid_request_error` | `invalid_type`            |
//! | `Overloaded`      | 429    | `overloaded_error`      | `overloaded` + `Retry-After` |
//! | `Cancelled`       | 499    | `cancelled`             | `cancelled`               |
//! | `Internal`        | 500    | `server_error`          | `internal_error`          |
//! | `Unavailable`     | 503    | `unavailable_error`     | `unavailable`             |
//! | `DeadlineExceeded`| 504    | `timeout_error`         | `deadline_exceeded`       |
//!
//! The body is always `{"error":{"message","type","param","code"}}`; mid-stream the same
//! object is sent as an SSE `data:` event (see `generate.rs`).
//!
//! The Anthropic Messages API (`POST /v1/messages`) answers in Anthropic's shape instead,
//! `{"type":"error","error":{"type","message"}}` ([`ServeError::to_anthropic_json`]), with
//! the same statuses except: JSON of the wrong shape is 400 (Anthropic has no 422) and
//! `Overloaded` is 529 `overloaded_error` (Anthropic's overload status; its SDK retries it).
//! Types: 400/405 `invalid_request_error`, 401 `authentication_error`, 404 `not_found_error`,
//! 413 `request_too_large`, 429 `rate_limit_error`, 529 `overloaded_error`, others `api_error`
//! (`anthropic-sdk-python`, `src/anthropic/types/shared/error_type.py`).

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use tandem_protocol::ErrorClass;
use tandem_router::RouteError;

/// The class of a [`ServeError`]: decides the status code, the error `type`, and whether a
/// client may retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Well-formed but invalid input: malformed JSON, impossible values, prompt too long.
    InvalidRequest,
    /// API keys are configured and the request has none, or one that is not known (see
    /// `auth.rs`).
    Unauthorized,
    /// The client took too long to send its body.
    RequestTimeout,
    /// The request names a model this frontend does not serve.
    ModelNotFound,
    /// No such route.
    NotFound,
    /// The route exists, the method does not.
    MethodNotAllowed,
    /// The body is over the configured limit.
    PayloadTooLarge,
    /// Well-formed JSON of the wrong shape or types.
    Unprocessable,
    /// No capacity now; retry after a while.
    Overloaded,
    /// The request was cancelled (client gone, or the backend cancelled it).
    Cancelled,
    /// Nothing can serve the request now (no workers, draining).
    Unavailable,
    /// A bug or a broken invariant.
    Internal,
    /// The request's deadline passed after it was dispatched (in the queue it is a 429).
    DeadlineExceeded,
}

impl ErrorKind {
    /// The HTTP status for this kind (the table in the module docs).
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::ModelNotFound | ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorKind::Overloaded => StatusCode::TOO_MANY_REQUESTS,
            // 499 "client closed request" (nginx): mostly seen in logs and metrics, since the
            // client is usually gone.
            ErrorKind::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// OpenAI's error `type` string.
    pub fn error_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::Unauthorized
            | ErrorKind::RequestTimeout
            | ErrorKind::ModelNotFound
            | ErrorKind::NotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::PayloadTooLarge
            | ErrorKind::Unprocessable => "invalid_request_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Internal => "server_error",
            ErrorKind::Unavailable => "unavailable_error",
            ErrorKind::DeadlineExceeded => "timeout_error",
        }
    }

    fn default_code(self) -> Option<&'static str> {
        match self {
            ErrorKind::InvalidRequest => None,
            ErrorKind::Unauthorized => Some("invalid_api_key"),
            ErrorKind::RequestTimeout => Some("request_timeout"),
            ErrorKind::ModelNotFound => Some("model_not_found"),
            ErrorKind::NotFound => Some("not_found"),
            ErrorKind::MethodNotAllowed => Some("method_not_allowed"),
            ErrorKind::PayloadTooLarge => Some("request_too_large"),
            ErrorKind::Unprocessable => Some("invalid_type"),
            ErrorKind::Overloaded => Some("overloaded"),
            ErrorKind::Cancelled => Some("cancelled"),
            ErrorKind::Internal => Some("internal_error"),
            ErrorKind::Unavailable => Some("unavailable"),
            ErrorKind::DeadlineExceeded => Some("deadline_exceeded"),
        }
    }
}

/// An error of the HTTP edge or of a [`super::Backend`], with its class.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ServeError {
    kind: ErrorKind,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
    retry_after: Option<Duration>,
}

impl ServeError {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ServeError {
            kind,
            message: message.into(),
            param: None,
            code: kind.default_code(),
            retry_after: None,
        }
    }

    /// 408: the body did not arrive in time.
    pub fn request_timeout(after: std::time::Duration) -> Self {
        Self::new(
            ErrorKind::RequestTimeout,
            format!(
                "the request body did not arrive within {} s",
                after.as_secs()
            ),
        )
    }

    /// 400: the request cannot be served as asked.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    /// 401 `invalid_api_key` (OpenAI's answer to a missing or wrong key; `WWW-Authenticate:
    /// Bearer` is added to the response).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unauthorized, message)
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            ErrorKind::ModelNotFound,
            format!("The model `{model}` does not exist."),
        )
        .with_param("model")
    }

    /// 404 for an unknown path.
    pub fn not_found(path: &str) -> Self {
        Self::new(ErrorKind::NotFound, format!("no route for {path}"))
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed() -> Self {
        Self::new(
            ErrorKind::MethodNotAllowed,
            "method not allowed on this route",
        )
    }

    /// 413: the body is over `limit` bytes.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            ErrorKind::PayloadTooLarge,
            format!("request body is larger than the limit of {limit} bytes"),
        )
    }

    /// 422: JSON of the wrong shape or types.
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unprocessable, message)
    }

    /// 429 with `Retry-After: ceil(retry_after)` seconds (at least 1).
    pub fn overloaded(message: impl Into<String>, retry_after: Duration) -> Self {
        let mut e = Self::new(ErrorKind::Overloaded, message);
        e.retry_after = Some(retry_after);
        e
    }

    /// 429 `budget_exceeded`: a token budget is spent; `retry_after`: when its window ends
    /// (none for a total).
    pub fn over_budget(message: impl Into<String>, retry_after: Option<Duration>) -> Self {
        let mut e = Self::new(ErrorKind::Overloaded, message).with_code("budget_exceeded");
        e.retry_after = retry_after;
        e
    }

    /// 499: cancelled.
    pub fn cancelled(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Cancelled, message)
    }

    /// 503: nothing can serve the request now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// 504: the request's deadline passed while it ran.
    pub fn deadline_exceeded(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::DeadlineExceeded, message)
    }

    /// 500: a bug or a broken invariant.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// Names the offending request field (OpenAI's `param`).
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Sets OpenAI's machine-readable `code` (e.g. `context_length_exceeded`).
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn param(&self) -> Option<&str> {
        self.param.as_deref()
    }

    pub fn code(&self) -> Option<&'static str> {
        self.code
    }

    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The OpenAI error object, `{"error":{"message","type","param","code"}}`, as JSON text.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Body<'a> {
            error: Inner<'a>,
        }
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'static str,
            param: Option<&'a str>,
            code: Option<&'static str>,
        }
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind.error_type(),
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        // Serializing strings and options into a String cannot fail.
        serde_json::to_string(&body).unwrap_or_else(|_| {
            r#"{"error":{"message":"error","type":"server_error","param":null,"code":null}}"#
                .to_string()
        })
    }
}

impl ServeError {
    /// The status on the Anthropic Messages API (see the module docs).
    pub fn anthropic_status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::Unprocessable => StatusCode::BAD_REQUEST,
            ErrorKind::Overloaded => {
                StatusCode::from_u16(529).unwrap_or(StatusCode::TOO_MANY_REQUESTS)
            }
            kind => kind.status(),
        }
    }

    /// Anthropic's error `type`.
    pub fn anthropic_type(&self) -> &'static str {
        match self.kind {
            ErrorKind::InvalidRequest
            | ErrorKind::Unprocessable
            | ErrorKind::MethodNotAllowed
            | ErrorKind::RequestTimeout => "invalid_request_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::ModelNotFound | ErrorKind::NotFound => "not_found_error",
            ErrorKind::PayloadTooLarge => "request_too_large",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::DeadlineExceeded => "timeout_error",
            ErrorKind::Cancelled | ErrorKind::Internal | ErrorKind::Unavailable => "api_error",
        }
    }

    /// Anthropic's error body, `{"type":"error","error":{"type","message"}}`.
    pub fn to_anthropic_json(&self) -> String {
        let message = match &self.param {
            Some(param) => format!("{param}: {}", self.message),
            None => self.message.clone(),
        };
        serde_json::json!({
            "type": "error",
            "error": {"type": self.anthropic_type(), "message": message},
        })
        .to_string()
    }

    /// The response on the Anthropic Messages API.
    pub fn into_anthropic_response(self) -> Response {
        let mut response = (
            self.anthropic_status(),
            [(header::CONTENT_TYPE, "application/json")],
            self.to_anthropic_json(),
        )
            .into_response();
        self.add_headers(&mut response);
        response
    }

    /// `Retry-After` on overload, `WWW-Authenticate` on 401 (RFC 9110 §11.6.1 asks for it).
    fn add_headers(&self, response: &mut Response) {
        if self.kind == ErrorKind::Unauthorized {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(after) = self.retry_after {
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
    }
}

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status(),
            [(header::CONTENT_TYPE, "application/json")],
            self.to_json(),
        )
            .into_response();
        self.add_headers(&mut response);
        response
    }
}

impl From<RouteError> for ServeError {
    /// Classified by [`RouteError::class`]: no workers → 503, a bad override → 400, a broken
    /// candidate list → 500, overload → 429 with `Retry-After: 1`.
    fn from(e: RouteError) -> Self {
        let message = e.to_string();
        match e.class() {
            ErrorClass::InvalidRequest => ServeError::invalid(message),
            ErrorClass::Overloaded => ServeError::overloaded(message, Duration::from_secs(1)),
            ErrorClass::Unavailable => ServeError::unavailable(message),
            ErrorClass::Cancelled => ServeError::cancelled(message),
            ErrorClass::Internal => ServeError::internal(message),
        }
    }
}
