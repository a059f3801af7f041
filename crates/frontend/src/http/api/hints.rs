//! Routing hints a request may carry (README "Routing"), validated at the edge into
//! [`RoutingHints`]:
//!
//! - the `tandem` body field (in the spirit of Dynamo's `nvext`), every member optional and
//!   unknown members refused: `overlap_credit`, `prefill_load_scale` and `temperature`
//!   override the `kv` policy's knobs for this request; `osl` is the output length the client
//!   expects; `session_id` names its session;
//! - `reasoning_effort` (chat completions; `reasoning.effort` on Responses): `minimal`, `low`,
//!   `medium`, `high` map to an expected output length when `osl` is not given;
//! - the session: the `x-session-id` header, else `tandem.session_id`, else the body field
//!   [`crate::http::HttpConfig::session_field`] names (`user` by default on OpenAI endpoints,
//!   `metadata.user_id` on Messages).
//!
//! The expected output length enters the router's decode-load term in place of `max_tokens`
//! (never above it), so long generations spread out and short ones are not queued behind
//! them; a session pins a conversation to its worker (see `tandem_router::sessions`).

use serde::Deserialize;
use tandem_router::KvOverrides;

use crate::http::error::ServeError;

/// Where a request's session id comes from besides `x-session-id` and `tandem.session_id`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum SessionField {
    /// OpenAI's `user` (chat completions, completions, Responses) and Anthropic's
    /// `metadata.user_id` (Messages).
    #[default]
    User,
    /// This top-level body field (a string, or a number taken as its decimal text).
    Field(String),
    /// No body field names the session.
    Off,
}

impl std::str::FromStr for SessionField {
    type Err = std::convert::Infallible;
    /// `user`, `none`, or a field name.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "user" => SessionField::User,
            "none" | "" => SessionField::Off,
            name => SessionField::Field(name.to_string()),
        })
    }
}

/// A top-level field of a JSON body as a session id (only read for [`SessionField::Field`]).
pub(crate) fn session_from_body(body: &[u8], field: &str) -> Option<String> {
    head_of(body, Some(field)).field_session
}

/// What the edge reads of a request body before it is validated: a few top-level members,
/// in one pass over the JSON that skips the rest (a long conversation is scanned, not built).
/// A body that is not a JSON object has no head (every member `None`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct BodyHead {
    /// `model`, where it is a string.
    pub(crate) model: Option<String>,
    /// `max_tokens`, else `max_completion_tokens`.
    pub(crate) max_tokens: Option<u32>,
    /// `tandem.session_id`.
    pub(crate) own_session: Option<String>,
    /// The member `head_of` was asked for, where it is a string or a number (its decimal
    /// text).
    pub(crate) field_session: Option<String>,
}

/// The [`BodyHead`] of `body`; `field`: the top-level member that names its session, if any.
pub(crate) fn head_of(body: &[u8], field: Option<&str>) -> BodyHead {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_slice(body);
    HeadSeed { field }.deserialize(&mut de).unwrap_or_default()
}

/// The body field that names the session under `field` (OpenAI's `user` for
/// [`SessionField::User`]), for [`head_of`].
pub(crate) fn session_member(field: &SessionField) -> Option<&str> {
    match field {
        SessionField::User => Some("user"),
        SessionField::Field(name) => Some(name),
        SessionField::Off => None,
    }
}

struct HeadSeed<'a> {
    field: Option<&'a str>,
}

impl<'de> serde::de::DeserializeSeed<'de> for HeadSeed<'_> {
    type Value = BodyHead;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<BodyHead, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for HeadSeed<'_> {
    type Value = BodyHead;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<BodyHead, A::Error> {
        use serde_json::Value;
        let count = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        let mut head = BodyHead::default();
        let mut max_completion_tokens = None;
        while let Some(key) = map.next_key::<String>()? {
            let named = self.field == Some(key.as_str());
            let known = matches!(
                key.as_str(),
                "model" | "max_tokens" | "max_completion_tokens" | "tandem"
            );
            if !named && !known {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            let value: Value = map.next_value()?;
            match key.as_str() {
                "model" => head.model = value.as_str().map(str::to_string),
                "max_tokens" => head.max_tokens = count(&value),
                "max_completion_tokens" => max_completion_tokens = count(&value),
                "tandem" => {
                    head.own_session = value
                        .get("session_id")
                        .and_then(Value::as_str)
                        .map(str::to_string);
                }
                _ => {}
            }
            if named {
                head.field_session = match value {
                    Value::String(s) => Some(s),
                    Value::Number(n) => Some(n.to_string()),
                    _ => None,
                };
            }
        }
        head.max_tokens = head.max_tokens.or(max_completion_tokens);
        Ok(head)
    }
}

/// The `tandem` body field as sent.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TandemField {
    overlap_credit: Option<f64>,
    prefill_load_scale: Option<f64>,
    temperature: Option<f64>,
    osl: Option<i64>,
    session_id: Option<String>,
}

/// Longest session id kept (longer ones are refused: they would only be hashed, but an id
/// that long is a client bug).
pub(crate) const MAX_SESSION_ID_BYTES: usize = 256;

/// Expected output tokens per `reasoning_effort` (a reasoning model's typical thinking budget
/// at each level, as vLLM's and SGLang's reasoning parsers see them in practice).
pub(crate) fn effort_tokens(effort: &str) -> Option<u32> {
    Some(match effort {
        "none" | "minimal" => 256,
        "low" => 1024,
        "medium" => 4096,
        "high" => 16_384,
        _ => return None,
    })
}

/// What the router takes from a request besides its tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingHints {
    /// Per-request `kv` knobs, each checked finite and `>= 0`.
    pub overrides: KvOverrides,
    /// Output tokens the client expects (`tandem.osl`, or from `reasoning_effort`); capped at
    /// `max_tokens` by the backend.
    pub expected_output_tokens: Option<u32>,
    /// The session (conversation, agent) the request belongs to.
    pub session: Option<String>,
}

/// Hint fields as the endpoint parsed them.
#[derive(Clone, Debug, Default)]
pub(crate) struct HintFields {
    pub tandem: Option<TandemField>,
    pub reasoning_effort: Option<String>,
    /// The value of the configured session field, when the body has it.
    pub session_field: Option<String>,
}

fn session_id(id: String, param: &'static str) -> Result<Option<String>, ServeError> {
    if id.is_empty() {
        return Ok(None);
    }
    if id.len() > MAX_SESSION_ID_BYTES {
        return Err(ServeError::invalid(format!(
            "a session id may be at most {MAX_SESSION_ID_BYTES} bytes long, got {}",
            id.len()
        ))
        .with_param(param));
    }
    Ok(Some(id))
}

impl HintFields {
    /// Checks every value (a 400 naming the field when one is out of range).
    pub(crate) fn check(self) -> Result<RoutingHints, ServeError> {
        let t = self.tandem.unwrap_or_default();
        let knob = |name: &'static str, v: Option<f64>| match v {
            Some(v) if !(v.is_finite() && v >= 0.0) => Err(ServeError::invalid(format!(
                "tandem.{name} must be a finite number >= 0, got {v}"
            ))
            .with_param(format!("tandem.{name}"))),
            v => Ok(v),
        };
        let overrides = KvOverrides {
            overlap_credit: knob("overlap_credit", t.overlap_credit)?,
            prefill_load_scale: knob("prefill_load_scale", t.prefill_load_scale)?,
            temperature: knob("temperature", t.temperature)?,
        };
        let expected_output_tokens = match (t.osl, self.reasoning_effort.as_deref()) {
            (Some(n), _) if n < 1 => {
                return Err(ServeError::invalid(format!(
                    "tandem.osl must be at least 1 (expected output tokens), got {n}"
                ))
                .with_param("tandem.osl"));
            }
            (Some(n), _) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            (None, Some(effort)) => Some(effort_tokens(effort).ok_or_else(|| {
                ServeError::invalid(format!(
                    "unknown reasoning_effort {effort:?}; use minimal, low, medium or high"
                ))
                .with_param("reasoning_effort")
            })?),
            (None, None) => None,
        };
        let session = match (t.session_id, self.session_field) {
            (Some(id), _) => session_id(id, "tandem.session_id")?,
            (None, Some(id)) => session_id(id, "user")?,
            (None, None) => None,
        };
        Ok(RoutingHints {
            overrides,
            expected_output_tokens,
            session,
        })
    }
}

/// `x-session-id`, which wins over the body's session.
pub(crate) fn apply_session_header(
    hints: &mut RoutingHints,
    headers: &axum::http::HeaderMap,
) -> Result<(), ServeError> {
    let Some(v) = headers.get("x-session-id") else {
        return Ok(());
    };
    let id = v.to_str().map_err(|_| {
        ServeError::invalid("header x-session-id is not visible ASCII").with_param("x-session-id")
    })?;
    if let Some(id) = session_id(id.trim().to_string(), "x-session-id")? {
        hints.session = Some(id);
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_bodys_head_is_read_in_one_pass_and_the_rest_skipped() {
        let body = br#"{"messages":[{"role":"user","content":"a \"quoted\" {x}"}],
            "m\u006fdel":"big","max_completion_tokens":7,"user":42,
            "tandem":{"session_id":"s-1","osl":9},"stream":true}"#;
        assert_eq!(
            head_of(body, Some("user")),
            BodyHead {
                model: Some("big".into()),
                max_tokens: Some(7),
                own_session: Some("s-1".into()),
                field_session: Some("42".into()),
            }
        );
        // max_tokens first; a member that is not a count, or no field asked for: None.
        let body = br#"{"max_tokens":3,"max_completion_tokens":7,"user":"u","model":1}"#;
        let head = head_of(body, None);
        assert_eq!(
            (head.max_tokens, head.field_session, head.model),
            (Some(3), None, None)
        );
        assert_eq!(head_of(br#"{"max_tokens":-1}"#, None).max_tokens, None);
        // The session field may be a known member too.
        assert_eq!(
            head_of(br#"{"model":"m"}"#, Some("model"))
                .field_session
                .as_deref(),
            Some("m")
        );
        for bad in [&b"[1,2]"[..], b"not json", b"", br#"{"model":"m""#] {
            assert_eq!(head_of(bad, Some("user")), BodyHead::default(), "{bad:?}");
        }
    }

    use super::*;

    fn fields(tandem: serde_json::Value) -> HintFields {
        HintFields {
            tandem: Some(serde_json::from_value(tandem).unwrap()),
            ..HintFields::default()
        }
    }

    #[test]
    fn knobs_osl_and_session_are_taken_and_checked() {
        let h = fields(serde_json::json!({
            "overlap_credit": 0.5, "temperature": 0.2, "osl": 300, "session_id": "s-1"
        }))
        .check()
        .unwrap();
        assert_eq!(h.overrides.overlap_credit, Some(0.5));
        assert_eq!(h.overrides.temperature, Some(0.2));
        assert_eq!(h.overrides.prefill_load_scale, None);
        assert_eq!(h.expected_output_tokens, Some(300));
        assert_eq!(h.session.as_deref(), Some("s-1"));
        for (bad, param) in [
            (
                serde_json::json!({"overlap_credit": -1.0}),
                "tandem.overlap_credit",
            ),
            (
                serde_json::json!({"prefill_load_scale": -0.1}),
                "tandem.prefill_load_scale",
            ),
            (serde_json::json!({"osl": 0}), "tandem.osl"),
        ] {
            let e = fields(bad).check().unwrap_err();
            assert_eq!(e.param(), Some(param), "{e:?}");
        }
        let long = "x".repeat(MAX_SESSION_ID_BYTES + 1);
        assert!(
            fields(serde_json::json!({"session_id": long}))
                .check()
                .is_err()
        );
        // Unknown members are refused, so a typo is not silently ignored.
        assert!(
            serde_json::from_value::<TandemField>(serde_json::json!({"temprature": 1})).is_err()
        );
    }

    #[test]
    fn reasoning_effort_maps_to_an_expected_length_unless_osl_is_given() {
        let effort = |e: &str, osl: Option<i64>| HintFields {
            tandem: osl.map(|n| serde_json::from_value(serde_json::json!({"osl": n})).unwrap()),
            reasoning_effort: Some(e.to_string()),
            session_field: None,
        };
        assert_eq!(
            effort("low", None).check().unwrap().expected_output_tokens,
            Some(1024)
        );
        assert_eq!(
            effort("high", None).check().unwrap().expected_output_tokens,
            Some(16_384)
        );
        assert_eq!(
            effort("high", Some(20))
                .check()
                .unwrap()
                .expected_output_tokens,
            Some(20)
        );
        let e = effort("extreme", None).check().unwrap_err();
        assert_eq!(e.param(), Some("reasoning_effort"));
    }

    #[test]
    fn the_session_comes_from_the_header_then_the_body() {
        let mut h = HintFields {
            session_field: Some("user-7".into()),
            ..HintFields::default()
        }
        .check()
        .unwrap();
        assert_eq!(h.session.as_deref(), Some("user-7"));
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("x-session-id", "conv-9".parse().unwrap());
        apply_session_header(&mut h, &headers).unwrap();
        assert_eq!(h.session.as_deref(), Some("conv-9"));
        // An empty field is no session.
        let h = HintFields {
            session_field: Some(String::new()),
            ..HintFields::default()
        }
        .check()
        .unwrap();
        assert_eq!(h.session, None);
    }
}
