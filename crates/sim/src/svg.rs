//! Hand-written SVG line charts (no plotting dependency): the TTFT CDF of a run and the
//! goodput-versus-rate curve of a sweep.

use std::fmt::Write;

use crate::metrics::SimReport;
use crate::sweep::SweepReport;

const W: f64 = 640.0;
const H: f64 = 400.0;
const PAD: f64 = 60.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// One named line of `(x, y)` points.
pub type Series = (String, Vec<(f64, f64)>);

/// A line chart of `series` with linear axes from 0 to the largest value.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let x_max = pts.clone().map(|p| p.0).fold(0.0, f64::max).max(1e-9);
    let y_max = pts.map(|p| p.1).fold(0.0, f64::max).max(1e-9);
    let sx = |x: f64| PAD + x / x_max * (W - 2.0 * PAD);
    let sy = |y: f64| H - PAD - y / y_max * (H - 2.0 * PAD);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>
<line x1="{PAD}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/>
<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{b}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>
"#,
        W / 2.0,
        esc(title),
        W / 2.0,
        H - 16.0,
        esc(x_label),
        H / 2.0,
        H / 2.0,
        esc(y_label),
        b = H - PAD,
        r = W - PAD,
    );
    for k in 0..=4 {
        let f = f64::from(k) / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text x="{}" y="{}" text-anchor="end">{}</text>"#,
            sx(f * x_max),
            H - PAD + 16.0,
            tick(f * x_max),
            PAD - 6.0,
            sy(f * y_max) + 4.0,
            tick(f * y_max)
        );
    }
    for (n, (name, points)) in series.iter().enumerate() {
        let color = COLORS[n % COLORS.len()];
        let path: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" fill="{color}">{}</text>"#,
            W - PAD - 150.0,
            PAD + 16.0 * n as f64,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn tick(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// TTFT CDF of each run.
pub fn ttft_cdf(runs: &[(&str, &SimReport)]) -> String {
    let series: Vec<Series> = runs
        .iter()
        .map(|(name, r)| {
            let pts = r
                .ttft_cdf_ms
                .iter()
                .enumerate()
                .map(|(p, &ms)| (ms, p as f64 / 100.0))
                .collect();
            ((*name).to_owned(), pts)
        })
        .collect();
    line_chart("TTFT CDF", "TTFT (ms)", "fraction of requests", &series)
}

/// Goodput (and throughput) against the swept rate.
pub fn goodput_curve(sweep: &SweepReport) -> String {
    let good = sweep
        .points
        .iter()
        .map(|p| (p.rate, p.report.goodput_rps))
        .collect();
    let thr = sweep
        .points
        .iter()
        .map(|p| (p.rate, p.report.throughput_rps))
        .collect();
    line_chart(
        "Goodput vs rate",
        sweep.rate_unit,
        "requests per second",
        &[("goodput".to_owned(), good), ("throughput".to_owned(), thr)],
    )
}

#[cfg(test)]
mod tests {
    use super::line_chart;

    #[test]
    fn chart_is_well_formed_svg() {
        let s = line_chart(
            "a<b",
            "x",
            "y",
            &[("s".into(), vec![(0.0, 0.0), (1.0, 2.0)])],
        );
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("a&lt;b") && s.contains("<polyline"));
    }
}
