//! JSON the way Hugging Face chat templates see it.
//!
//! - [`Json`]: a JSON value that keeps object keys in the order they were sent. Python dicts
//!   keep insertion order, and templates show it (`tool | tojson`, `tool.items()` in
//!   Mistral's); `serde_json::Value` (without `preserve_order`) and minijinja's maps (without
//!   its `preserve_order`) sort keys instead.
//! - [`Json::to_value`]: into a template value, objects as an ordered map object.
//! - [`dumps`] / [`tojson_filter`]: Python's `json.dumps`, which transformers installs as the
//!   `tojson` filter (`src/transformers/utils/chat_template_utils.py`: `json.dumps(x,
//!   ensure_ascii=False, indent=None, separators=None, sort_keys=False)`); minijinja's own
//!   `tojson` escapes `<`, `>`, `&`, `'` for HTML and so changes what the model sees.

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectExt, ObjectRepr, Value, ValueKind};
use minijinja::{Error, ErrorKind};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// A JSON value with object keys in document order (a repeated key keeps its first position
/// and its last value, as Python's `json.loads` does).
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parses JSON text (as in a tool call's `arguments` string).
    pub fn parse(text: &str) -> Result<Json, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Compact JSON text, keys in order (OpenAI's `arguments` strings).
    pub fn to_compact(&self) -> String {
        // Serializing our own tree into a String cannot fail (non-finite floats become null).
        serde_json::to_string(self).unwrap_or_else(|_| "null".to_string())
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value under `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }

    /// The template value; every string (keys too) goes through `text`, which is where the
    /// chat template defuses special-token strings sent by the client.
    pub(crate) fn to_value(&self, text: &dyn Fn(&str) -> String) -> Value {
        match self {
            Json::Null => Value::from(()),
            Json::Bool(b) => Value::from(*b),
            Json::Int(i) => Value::from(*i),
            Json::UInt(u) => Value::from(*u),
            Json::Float(f) => Value::from(*f),
            Json::Str(s) => Value::from(text(s)),
            Json::Array(items) => {
                Value::from(items.iter().map(|v| v.to_value(text)).collect::<Vec<_>>())
            }
            Json::Object(entries) => OrderedMap::value(
                entries
                    .iter()
                    .map(|(k, v)| (text(k), v.to_value(text)))
                    .collect(),
            ),
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        Json::deserialize(d)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(match i64::try_from(v) {
            Ok(i) => Json::Int(i),
            Err(_) => Json::UInt(v),
        })
    }
    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut entries: Vec<(String, Json)> = Vec::new();
        while let Some((key, value)) = map.next_entry::<String, Json>()? {
            match entries.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = value,
                None => entries.push((key, value)),
            }
        }
        Ok(Json::Object(entries))
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Int(i) => s.serialize_i64(*i),
            Json::UInt(u) => s.serialize_u64(*u),
            Json::Float(f) => s.serialize_f64(*f),
            Json::Str(v) => s.serialize_str(v),
            Json::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

/// A template map that iterates in insertion order.
#[derive(Debug)]
pub(crate) struct OrderedMap {
    entries: Vec<(Value, Value)>,
    /// Key → position, built for larger maps so that lookups stay O(1).
    index: Option<HashMap<String, usize>>,
}

impl OrderedMap {
    /// A map value from `(key, value)` pairs, in order.
    pub(crate) fn value(entries: Vec<(String, Value)>) -> Value {
        let index = (entries.len() > 16).then(|| {
            entries
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (k.clone(), i))
                .collect()
        });
        let entries = entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect();
        Value::from_object(OrderedMap { entries, index })
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        match &self.index {
            Some(index) => index.get(key).map(|&i| self.entries[i].1.clone()),
            None => self
                .entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v.clone()),
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_key_value_enumerator(|this| Box::new(this.entries.iter().cloned()))
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }
}

/// `json.dumps` options (Python's defaults: `ensure_ascii=False` as transformers sets it).
#[derive(Clone, Debug)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `Some` pretty-prints: a newline and this indent per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// Deeper values than this are refused rather than risking the stack.
const MAX_DEPTH: usize = 512;

/// Python's `json.dumps(value, **options)` for a template value.
pub(crate) fn dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, options, 0)?;
    Ok(out)
}

/// The `tojson` filter with transformers' signature: `tojson(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, by keyword, or positionally up to
/// `separators` (minijinja functions take at most five arguments; no template passes
/// `sort_keys` positionally).
pub(crate) fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let sort_keys = None;
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named
            .or(positional)
            .filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?;
    let indent = pick(indent, "indent")?;
    let separators = pick(separators, "separators")?;
    let sort_keys = pick(sort_keys, "sort_keys")?;
    kwargs.assert_all_used()?;

    let mut options = DumpOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..DumpOptions::default()
    };
    if let Some(indent) = indent {
        options.indent = Some(match indent.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = i64::try_from(indent).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an int or str",
                    )
                })?;
                // Python treats a negative indent as zero.
                " ".repeat(usize::try_from(n.clamp(0, 64)).unwrap_or(0))
            }
        });
        // With an indent, Python's default item separator drops the trailing space.
        options.item_separator = ",".to_string();
    }
    if let Some(separators) = separators {
        let parts: Vec<Value> = separators.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] => {
                options.item_separator = item.to_string();
                options.key_separator = key.to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be an (item_separator, key_separator) pair",
                ));
            }
        }
    }
    dumps(value, &options).map(Value::from)
}

fn write_value(out: &mut String, v: &Value, o: &DumpOptions, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => {
            let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
            write_float(out, f);
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Bytes => {
            let bytes = v.as_bytes().unwrap_or_default();
            write_seq(out, bytes.iter().map(|b| Value::from(*b)), o, depth)?;
        }
        ValueKind::Seq | ValueKind::Iterable => write_seq(out, v.try_iter()?, o, depth)?,
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for key in v.try_iter()? {
                let item = v.get_item(&key)?;
                pairs.push((key, item));
            }
            if o.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if pairs.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in pairs.iter().enumerate() {
                separate(out, i == 0, o, depth + 1);
                write_key(out, key, o)?;
                out.push_str(&o.key_separator);
                write_value(out, item, o, depth + 1)?;
            }
            close(out, o, depth);
            out.push('}');
        }
        // Functions, macros and other plain objects: Python would fail; their string form is
        // the most useful thing to show.
        _ => write_str(out, &v.to_string(), o.ensure_ascii),
    }
    Ok(())
}

fn write_seq(
    out: &mut String,
    items: impl Iterator<Item = Value>,
    o: &DumpOptions,
    depth: usize,
) -> Result<(), Error> {
    let mut first = true;
    for item in items {
        if first {
            out.push('[');
        }
        separate(out, first, o, depth + 1);
        first = false;
        write_value(out, &item, o, depth + 1)?;
    }
    if first {
        out.push_str("[]");
    } else {
        close(out, o, depth);
        out.push(']');
    }
    Ok(())
}

/// Before an item: the item separator (not before the first), then with an indent a newline
/// and the indent of `depth`.
fn separate(out: &mut String, first: bool, o: &DumpOptions, depth: usize) {
    if !first {
        out.push_str(&o.item_separator);
    }
    if let Some(indent) = &o.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// Before a closing bracket of a non-empty container.
fn close(out: &mut String, o: &DumpOptions, depth: usize) {
    if let Some(indent) = &o.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// Python turns non-string keys into strings: `True` → "true", `None` → "null", numbers as
/// their repr.
fn write_key(out: &mut String, key: &Value, o: &DumpOptions) -> Result<(), Error> {
    match key.kind() {
        ValueKind::String => write_str(out, key.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Bool | ValueKind::None | ValueKind::Number | ValueKind::Undefined => {
            let mut text = String::new();
            write_value(&mut text, key, o, 0)?;
            write_str(out, &text, o.ensure_ascii);
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            ));
        }
    }
    Ok(())
}

/// A JSON string literal as Python writes it: `"`, `\`, and control characters escaped
/// (`\n`, `\r`, `\t`, `\b`, `\f`, else `\u00XX`); with `ensure_ascii`, everything above
/// U+007F as `\uXXXX` (surrogate pairs beyond the BMP).
fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7E => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `float.__repr__`: the shortest round-trip digits, fixed notation for decimal exponents in
/// `-4..16` (always with a fractional part), else `d.ddde+XX`; non-finite values as Python's
/// `json.dumps` writes them (`NaN`, `Infinity`, `-Infinity`).
pub(crate) fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // Rust's `{:e}` writes the shortest round-trip digits: "1.2345e-5", "1e16", "0e0".
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if f.is_sign_negative() {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn py_float(f: f64) -> String {
        let mut s = String::new();
        write_float(&mut s, f);
        s
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (100.0, "100.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(py_float(f), want, "{f:e}");
        }
    }

    #[test]
    fn parse_keeps_key_order_and_dumps_like_python() {
        let j =
            Json::parse(r#"{"z": 1, "a": [1.0, "é\n\"", null, true], "m": {}, "z": 2}"#).unwrap();
        assert_eq!(
            j.to_compact(),
            r#"{"z":2,"a":[1.0,"é\n\"",null,true],"m":{}}"#
        );
        let v = j.to_value(&|s| s.to_string());
        let default = dumps(&v, &DumpOptions::default()).unwrap();
        assert_eq!(
            default,
            r#"{"z": 2, "a": [1.0, "é\n\"", null, true], "m": {}}"#
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&Value::from("é😀<>&'"), &ascii).unwrap(),
            r#""\u00e9\ud83d\ude00<>&'""#
        );
        let pretty = DumpOptions {
            indent: Some("    ".into()),
            item_separator: ",".into(),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &pretty).unwrap(),
            "{\n    \"z\": 2,\n    \"a\": [\n        1.0,\n        \"é\\n\\\"\",\n        null,\n        \
             true\n    ],\n    \"m\": {}\n}"
        );
        let sorted = DumpOptions {
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert!(dumps(&v, &sorted).unwrap().starts_with(r#"{"a": "#));
    }

    #[test]
    fn ordered_map_behaves_as_a_template_dict() {
        let v = Json::parse(r#"{"b": 1, "a": 2}"#)
            .unwrap()
            .to_value(&|s| s.to_string());
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        let out = env
            .render_str(
                "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.a }}{{ d['b'] }}\
                 {{ d | length }}{{ 'a' in d }}{{ d.get('x', 7) }}|{{ d | tojson(indent=2) }}|\
                 {{ d | tojson(separators=(',', ':')) }}|{{ d == d2 }}",
                minijinja::context! { d => v.clone(), d2 => v },
            )
            .unwrap();
        assert_eq!(
            out,
            "b=1;a=2;212True7|{\n  \"b\": 1,\n  \"a\": 2\n}|{\"b\":1,\"a\":2}|True"
        );
    }
}
