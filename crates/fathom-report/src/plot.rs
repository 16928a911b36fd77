//! Error-against-bits plots (PNG, log y): one curve per budgeted method family, one point per
//! fixed method.

use std::path::Path;

use fathom_results::fidelity::MethodRow;
use plotters::prelude::*;

use crate::ReportError;

type Result<T> = std::result::Result<T, ReportError>;

fn draw<E: std::fmt::Display>(e: E) -> ReportError {
    ReportError::Plot(e.to_string())
}

/// Registers the labels' font: DejaVu Sans, embedded in the binary (the `dejavu` crate), so a
/// plot needs no font installed on any OS.
fn register_font() -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| ReportError::Plot("the embedded DejaVu Sans could not be loaded".into()))
}

/// Distinct colours (Okabe–Ito plus extras), so neighbouring families never look alike.
const PALETTE: [RGBColor; 12] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
    RGBColor(120, 60, 160),
    RGBColor(160, 40, 40),
    RGBColor(100, 100, 100),
    RGBColor(40, 120, 40),
];

fn family(name: &str) -> &str {
    name.split(':').next().unwrap_or(name)
}

/// Writes the plot of `methods`' error against bits to `path` atomically (rendered into a
/// temporary PNG, then renamed): one curve per budgeted method family, one point per fixed
/// method, a horizontal line per full-precision oracle.
pub fn error_vs_bits(methods: &[MethodRow], title: &str, path: &Path) -> Result<()> {
    register_font()?;
    let pts: Vec<(&str, f64, f64)> = methods
        .iter()
        .filter(|m| m.error > 0.0 && m.bits > 0.0)
        .map(|m| (m.name.as_str(), m.bits, m.error))
        .collect();
    if pts.is_empty() {
        return Err(ReportError::Plot(
            "nothing to plot: every method has zero error or zero bits".into(),
        ));
    }
    // Oracles that read full-precision keys (thousands of bits) are drawn as horizontal lines.
    let xmax = pts
        .iter()
        .map(|p| p.1)
        .filter(|&b| b <= 600.0)
        .fold(16.0, f64::max)
        * 1.08;
    let ymin = pts.iter().map(|p| p.2).fold(f64::INFINITY, f64::min) / 1.5;
    let ymax = pts.iter().map(|p| p.2).fold(0.0, f64::max) * 1.5;
    let tmp = path.with_extension(format!("tmp-{}.png", std::process::id()));
    let _cleanup = RemoveOnDrop(&tmp);
    {
        let root = BitMapBackend::new(&tmp, (1000, 650)).into_drawing_area();
        root.fill(&WHITE).map_err(draw)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..xmax, (ymin..ymax).log_scale())
            .map_err(draw)?;
        chart
            .configure_mesh()
            .x_desc("bits per token per KV head")
            .y_desc("mean relative error of attention output")
            .y_label_formatter(&|y| format!("{y:.3}"))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(draw)?;
        let mut families: Vec<&str> = pts.iter().map(|p| family(p.0)).collect();
        families.dedup();
        families.sort();
        families.dedup();
        for (i, fam) in families.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()].to_rgba();
            let mut series: Vec<(f64, f64)> = pts
                .iter()
                .filter(|p| family(p.0) == *fam && p.1 <= xmax)
                .map(|p| (p.1, p.2))
                .collect();
            series.sort_by(|a, b| a.0.total_cmp(&b.0));
            let oracle = pts
                .iter()
                .filter(|p| family(p.0) == *fam && p.1 > xmax)
                .map(|p| p.2)
                .next();
            if let Some(e) = oracle {
                chart
                    .draw_series(LineSeries::new(
                        vec![(0.0, e), (xmax, e)],
                        color.stroke_width(1),
                    ))
                    .map_err(draw)?
                    .label(format!("{fam} (full-precision keys)"))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(1))
                    });
                continue;
            }
            if series.len() > 1 {
                chart
                    .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))
                    .map_err(draw)?
                    .label(*fam)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(
                        series
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )
                    .map_err(draw)?;
            } else {
                chart
                    .draw_series(
                        series
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 6, color.filled())),
                    )
                    .map_err(draw)?
                    .label(*fam)
                    .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.filled()));
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(draw)?;
        root.present().map_err(|e| {
            ReportError::Plot(format!("rendering the plot into {}: {e}", path.display()))
        })?;
    }
    commit_png(&tmp, path)
}

/// Makes the rendered temporary PNG durable and moves it to `path` (atomic rename).
fn commit_png(tmp: &Path, path: &Path) -> Result<()> {
    std::fs::File::open(tmp)
        .and_then(|f| f.sync_all())
        .and_then(|()| std::fs::rename(tmp, path))
        .map_err(|source| ReportError::Io {
            path: path.into(),
            source,
        })
}

/// Removes a temporary file on every exit (after a successful rename it is already gone).
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Writes aggregate decode tokens/s against the batch size (log x) to `path` atomically, one
/// line per method: `points` are `(method, batch, tokens_per_s)`.
pub fn tokens_vs_batch(points: &[(String, usize, f64)], title: &str, path: &Path) -> Result<()> {
    throughput_plot(
        points,
        (
            "sessions decoding together (B)",
            "aggregate tokens per second",
        ),
        &|x| format!("{x:.0}"),
        SeriesLabelPosition::UpperLeft,
        title,
        path,
    )
}

/// Writes per-session decode tokens/s against the context (log x, tokens) to `path`
/// atomically, one line per method: `points` are `(method, context tokens, tokens_per_s)`.
pub fn tokens_vs_context(points: &[(String, usize, f64)], title: &str, path: &Path) -> Result<()> {
    throughput_plot(
        points,
        (
            "context of each session (tokens)",
            "tokens per second per session",
        ),
        &|x| {
            if *x >= 1024.0 {
                format!("{:.0}k", x / 1024.0)
            } else {
                format!("{x:.0}")
            }
        },
        // The curves fall to the right.
        SeriesLabelPosition::UpperRight,
        title,
        path,
    )
}

/// One line per method of `(method, x, y)` points, x on a log₂ scale.
fn throughput_plot(
    points: &[(String, usize, f64)],
    (x_desc, y_desc): (&str, &str),
    x_fmt: &dyn Fn(&f64) -> String,
    legend: SeriesLabelPosition,
    title: &str,
    path: &Path,
) -> Result<()> {
    register_font()?;
    let pts: Vec<&(String, usize, f64)> = points
        .iter()
        .filter(|p| p.1 > 0 && p.2.is_finite() && p.2 > 0.0)
        .collect();
    if pts.is_empty() {
        return Err(ReportError::Plot(
            "nothing to plot: no positive throughput".into(),
        ));
    }
    // x on a log₂ axis with a tick at every power of two (1, 2, 4 … or 64k, 128k …).
    let l2 = |x: usize| (x as f64).log2();
    let lo = pts
        .iter()
        .map(|p| l2(p.1))
        .fold(f64::INFINITY, f64::min)
        .floor();
    let hi = pts
        .iter()
        .map(|p| l2(p.1))
        .fold(f64::NEG_INFINITY, f64::max)
        .ceil();
    let (xmin, xmax) = (lo - 0.3, hi + 0.3);
    let ticks = (hi - lo) as usize + 1;
    let x_tick = |v: &f64| {
        if (v - v.round()).abs() < 1e-6 {
            x_fmt(&v.round().exp2())
        } else {
            String::new()
        }
    };
    let ymax = pts.iter().map(|p| p.2).fold(0.0, f64::max) * 1.1;
    let tmp = path.with_extension(format!("tmp-{}.png", std::process::id()));
    let _cleanup = RemoveOnDrop(&tmp);
    {
        let root = BitMapBackend::new(&tmp, (1000, 650)).into_drawing_area();
        root.fill(&WHITE).map_err(draw)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(80)
            .build_cartesian_2d(xmin..xmax, 0f64..ymax)
            .map_err(draw)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_labels(ticks + 1)
            .x_label_formatter(&x_tick)
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()
            .map_err(draw)?;
        let mut methods: Vec<&str> = pts.iter().map(|p| p.0.as_str()).collect();
        methods.sort();
        methods.dedup();
        for (i, m) in methods.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()].to_rgba();
            let mut series: Vec<(f64, f64)> = pts
                .iter()
                .filter(|p| p.0 == *m)
                .map(|p| (l2(p.1), p.2))
                .collect();
            series.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))
                .map_err(draw)?
                .label(*m)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    series
                        .iter()
                        .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
                )
                .map_err(draw)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(legend)
            .draw()
            .map_err(draw)?;
        root.present().map_err(|e| {
            ReportError::Plot(format!("rendering the plot into {}: {e}", path.display()))
        })?;
    }
    commit_png(&tmp, path)
}
