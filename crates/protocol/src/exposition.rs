//! The Prometheus text exposition format, read: what engines (vLLM, SGLang) and tandem's own
//! frontends serve at `/metrics`, parsed into [`Sample`]s. The one parser of it in the
//! workspace: the external-engine sidecar reads engines' load with [`parse_lenient`], the
//! planner reads the frontends' counters and histograms with [`parse`].
//!
//! Formats followed: <https://prometheus.io/docs/instrumenting/exposition_formats/> (text
//! format 0.0.4) and OpenMetrics
//! (<https://github.com/prometheus/OpenMetrics/blob/main/specification/OpenMetrics.md>):
//! `# TYPE` / `# HELP` / `# EOF` comments, `name{label="value",…} value [timestamp]` samples,
//! label values escaping `\\`, `\"` and `\n`, and `+Inf`, `-Inf` and `NaN` as values.

/// One sample line: metric name, labels, value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A line that is not a sample: its number (from 1) and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {why}")]
pub struct BadLine {
    pub line: usize,
    pub why: String,
}

/// Every sample of a page, in order; comments and blank lines skipped; the first malformed
/// line is an error.
pub fn parse(text: &str) -> Result<Vec<Sample>, BadLine> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if let Some(sample) = sample_of(line) {
            out.push(sample.map_err(|why| BadLine { line: i + 1, why })?);
        }
    }
    Ok(out)
}

/// Every well-formed sample of a page: malformed lines are skipped (one odd line of an
/// engine's must not blind the reader to the rest).
pub fn parse_lenient(text: &str) -> Vec<Sample> {
    text.lines()
        .filter_map(sample_of)
        .filter_map(Result::ok)
        .collect()
}

/// None for a comment or a blank line.
fn sample_of(line: &str) -> Option<Result<Sample, String>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    Some(parse_line(line))
}

fn parse_line(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("a sample without a value")?;
    let name = line[..name_end].to_string();
    if name.is_empty() {
        return Err("a sample without a name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        rest = parse_labels(r, &mut labels)?;
    }
    let value = rest
        .split_whitespace()
        .next()
        .ok_or("a sample without a value")?;
    Ok(Sample {
        name,
        labels,
        value: parse_value(value)?,
    })
}

/// Reads `k="v",…}` into `labels`; the text after the closing brace.
fn parse_labels<'a>(mut s: &'a str, labels: &mut Vec<(String, String)>) -> Result<&'a str, String> {
    loop {
        s = s.trim_start();
        if let Some(r) = s.strip_prefix('}') {
            return Ok(r);
        }
        let eq = s.find('=').ok_or("a label without '='")?;
        let key = s[..eq].trim().to_string();
        let r = s[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .ok_or("a label value without its opening quote")?;
        let mut value = String::new();
        let mut chars = r.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("a label value without its closing quote".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("a dangling escape".into()),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key, value));
        s = r[end + 1..].trim_start();
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

/// A sample value or an `le` bound: a float, `+Inf` / `Inf`, `-Inf` or `NaN`.
pub fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v.parse().map_err(|_| format!("not a number: {v:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_labels_escapes_and_special_values() {
        let text = "# HELP x help\n# TYPE x counter\nx_total 3\n\
                    h_bucket{le=\"+Inf\",path=\"a\\\"b\\\\c\\nd\"} 7 1700000000000\n\
                    g{a=\"1\",} NaN\n\n# EOF\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "x_total");
        assert_eq!(s[0].value, 3.0);
        assert_eq!(s[1].label("le"), Some("+Inf"));
        assert_eq!(s[1].label("path"), Some("a\"b\\c\nd"));
        assert_eq!(s[1].value, 7.0);
        assert!(s[2].value.is_nan());
        assert_eq!(parse_value("-Inf"), Ok(f64::NEG_INFINITY));
    }

    #[test]
    fn malformed_lines_are_an_error_or_skipped() {
        let text = "ok 1\nbroken{a=\"1\" 2\nnovalue\nalso_ok{b=\"x\"} 2\n";
        let e = parse(text).unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        let s = parse_lenient(text);
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["ok", "also_ok"]);
    }
}
