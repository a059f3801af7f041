//! Standalone SVG line charts, drawn with `plotters` (its SVG backend and line series only:
//! no font files, no bitmap or system libraries). Axes start at 0 and end 5 % above the largest
//! value shown; every chart has a title, axis labels, a grid with ticks and a legend. Text is SVG
//! `<text>` in the viewer's sans-serif font; plotters only estimates its width for the layout.
//!
//! [`ttft_cdf`] and [`goodput_vs_rate`] are the two figures `tandem sim` and `tandem bench`
//! write; [`line_chart`] draws any other.

use plotters::prelude::*;

use crate::error::WorkloadError;

const SIZE: (u32, u32) = (640, 400);
/// Colors of the successive series (matplotlib's first six).
const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// One named line of `(x, y)` points.
pub type Series = (String, Vec<(f64, f64)>);

/// Where the legend goes: a corner the lines leave empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Legend {
    UpperLeft,
    LowerRight,
}

/// A line chart of `series` on linear axes from 0 to just above the largest value, legend at
/// the lower right. Returns the SVG document.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<String, WorkloadError> {
    chart(title, x_label, y_label, series, Legend::LowerRight)
}

/// The TTFT CDF of each run, from its TTFT at each percent 0…100
/// ([`crate::LatencyHistogram::cdf_ms`]).
pub fn ttft_cdf(runs: &[(&str, &[f64])]) -> Result<String, WorkloadError> {
    let series: Vec<Series> = runs
        .iter()
        .map(|(name, cdf)| {
            let pts = cdf
                .iter()
                .enumerate()
                .map(|(p, &ms)| (ms, p as f64 / 100.0))
                .collect();
            ((*name).to_owned(), pts)
        })
        .collect();
    chart(
        "TTFT CDF",
        "TTFT (ms)",
        "fraction of requests",
        &series,
        Legend::LowerRight,
    )
}

/// Goodput and throughput (requests per second) against the offered rate, from
/// `(rate, goodput, throughput)` points; `rate_label` names the rate's unit.
pub fn goodput_vs_rate(
    rate_label: &str,
    points: &[(f64, f64, f64)],
) -> Result<String, WorkloadError> {
    let good = points.iter().map(|&(r, g, _)| (r, g)).collect();
    let thr = points.iter().map(|&(r, _, t)| (r, t)).collect();
    chart(
        "Goodput vs rate",
        rate_label,
        "requests per second",
        &[("goodput".to_owned(), good), ("throughput".to_owned(), thr)],
        Legend::UpperLeft,
    )
}

/// Any drawing error of plotters, as ours (it draws into a `String`, so none is expected).
fn plot_error(e: impl std::fmt::Display) -> WorkloadError {
    WorkloadError::Plot(e.to_string())
}

/// 5 % above the largest finite value of `values` (so no line runs along the frame), at least
/// a tiny positive width.
fn axis_end(values: impl Iterator<Item = f64>) -> f64 {
    let max = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    (max * 1.05).max(1e-9)
}

fn chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    legend: Legend,
) -> Result<String, WorkloadError> {
    let pts = || series.iter().flat_map(|(_, p)| p.iter());
    let x_end = axis_end(pts().map(|p| p.0));
    let y_end = axis_end(pts().map(|p| p.1));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x_end, 0.0..y_end)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .max_light_lines(0)
            .draw()
            .map_err(plot_error)?;
        for (n, (name, points)) in series.iter().enumerate() {
            let color = COLORS[n % COLORS.len()];
            let finite = points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite());
            chart
                .draw_series(LineSeries::new(finite, color.stroke_width(2)))
                .map_err(plot_error)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(match legend {
                Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
                Legend::LowerRight => SeriesLabelPosition::LowerRight,
            })
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_standalone_svg_with_title_labels_and_legend() {
        let s = line_chart(
            "a<b",
            "x axis",
            "y axis",
            &[("first".into(), vec![(0.0, 0.0), (1.0, 2.0)])],
        )
        .unwrap();
        assert!(
            s.starts_with("<svg") && s.trim_end().ends_with("</svg>"),
            "{s}"
        );
        for text in ["a&lt;b", "x axis", "y axis", "first", "<polyline"] {
            assert!(s.contains(text), "{text}");
        }
    }

    #[test]
    fn empty_and_degenerate_series_still_draw() {
        assert!(line_chart("t", "x", "y", &[]).unwrap().starts_with("<svg"));
        let flat = [("z".to_owned(), vec![(0.0, 0.0), (f64::NAN, 1.0)])];
        assert!(
            line_chart("t", "x", "y", &flat)
                .unwrap()
                .starts_with("<svg")
        );
        let cdf: Vec<f64> = (0..=100).map(f64::from).collect();
        let s = ttft_cdf(&[("kv", &cdf), ("round-robin", &cdf)]).unwrap();
        assert!(s.contains("round-robin") && s.contains("TTFT (ms)"));
        let s =
            goodput_vs_rate("requests_per_second", &[(1.0, 1.0, 1.0), (2.0, 1.5, 2.0)]).unwrap();
        assert!(s.contains("goodput") && s.contains("throughput"));
    }
}

/// `(rate, goodput, throughput)` of each point of a sweep, requests per second.
pub type GoodputPoints = Vec<(f64, f64, f64)>;

/// The figures of one run (a TTFT CDF) or of a sweep (a CDF per rate, and goodput against the
/// rate), as `tandem sim` and `tandem bench` write them.
#[derive(Clone, Debug, Default)]
pub struct Figures<'a> {
    /// `(label, TTFT at each percent 0…100)` of each run.
    pub ttft_cdfs: Vec<(String, &'a [f64])>,
    /// For a sweep of more than one rate: the rate's unit and `(rate, goodput, throughput)`.
    pub goodput: Option<(&'a str, GoodputPoints)>,
}

impl Figures<'_> {
    /// Writes `ttft_cdf.svg` (and `goodput_vs_rate.svg` for a sweep) into `dir`, made if
    /// missing.
    pub fn write(&self, dir: &std::path::Path) -> Result<(), WorkloadError> {
        let io = |path: &std::path::Path| {
            let path = path.display().to_string();
            move |source| WorkloadError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let runs: Vec<(&str, &[f64])> = self
            .ttft_cdfs
            .iter()
            .map(|(label, cdf)| (label.as_str(), *cdf))
            .collect();
        let mut files = vec![("ttft_cdf.svg", ttft_cdf(&runs)?)];
        if let Some((unit, points)) = &self.goodput {
            files.push(("goodput_vs_rate.svg", goodput_vs_rate(unit, points)?));
        }
        for (name, svg) in files {
            let path = dir.join(name);
            std::fs::write(&path, svg).map_err(io(&path))?;
        }
        Ok(())
    }
}

/// Writes `value` as pretty JSON to `path` (the `--json` record of a run or a sweep).
pub fn write_json(
    path: &std::path::Path,
    value: &impl serde::Serialize,
) -> Result<(), WorkloadError> {
    let io = |source| WorkloadError::Io {
        path: path.display().to_string(),
        source,
    };
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| io(std::io::Error::other(e)))?;
    std::fs::write(path, bytes).map_err(io)
}
