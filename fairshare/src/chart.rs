//! A picture of who got what: admitted calls per caller per period, against the floor and
//! ceiling each was owed, as a standalone SVG.

use std::fmt::Write as _;

use crate::simulate::{label, CallerRow, PeriodRow, Report};

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders `report` as an SVG line chart: one solid line per caller (admitted per period), a
/// dashed line at its ceiling and a dotted line at its floor, the tool's capacity in grey,
/// what all callers were admitted in thin grey, and the reserved floors each period left
/// unused ([`PeriodRow::unserved_floors`](crate::simulate::PeriodRow::unserved_floors)) shaded
/// below the capacity.
///
/// ```
/// # use fairshare::simulate::{Report, PeriodRow, CallerRow};
/// let row = CallerRow { tenant: Some("A".into()), instance: None, offered: 10, admitted: 5, refused: 5, floor: 2.0, ceiling: 5.0 };
/// let period = PeriodRow { start_ms: 0, callers: vec![row.clone()], admitted: 5, unserved_floors: 3.0 };
/// let report = Report { periods: vec![period], totals: vec![row] };
/// let svg = fairshare::chart::svg(&report, "demo", 10.0, "1m");
/// assert!(svg.starts_with("<svg"));
/// // The 3 units of floors kept unused are shaded below the capacity, and named.
/// assert!(svg.contains("<title>floors kept unused: 3</title>"));
/// assert!(svg.contains("up to 3 a period kept for idle tenants' floors"));
/// ```
pub fn svg(report: &Report, title: &str, capacity: f64, period: &str) -> String {
    let f = Frame::new(report, capacity);
    let mut o = String::new();
    f.axes(&mut o, title, period);
    f.capacity(&mut o, report);
    for i in 0..report.totals.len() {
        f.caller(&mut o, report, i);
    }
    o.push_str("</svg>\n");
    o
}

/// Where the chart draws: its size, margins, periods and the top of its scale.
struct Frame {
    w: f64,
    h: f64,
    left: f64,
    top: f64,
    /// The plot's width and height.
    pw: f64,
    ph: f64,
    /// Periods along the x axis.
    n: usize,
    /// The scale's step and top.
    step: f64,
    ticks: usize,
    ymax: f64,
    capacity: f64,
}

impl Frame {
    fn new(report: &Report, capacity: f64) -> Frame {
        let (w, h) = (900.0, 480.0);
        let (left, right, top, bottom) = (60.0, 220.0, 56.0, 50.0);
        let mut ymax = capacity;
        for p in &report.periods {
            for c in &p.callers {
                ymax = ymax.max(c.admitted as f64).max(c.ceiling);
            }
        }
        // A round step: 1, 2 or 5 × 10^k, five or so of them.
        let raw = (ymax * 1.1).max(1.0) / 5.0;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * mag)
            .find(|s| *s >= raw)
            .unwrap_or(10.0 * mag);
        let ticks = ((ymax * 1.1) / step).ceil().max(1.0) as usize;
        Frame {
            w,
            h,
            left,
            top,
            pw: w - left - right,
            ph: h - top - bottom,
            n: report.periods.len().max(1),
            step,
            ticks,
            ymax: step * ticks as f64,
            capacity,
        }
    }

    /// The x of period `k` (from 0).
    fn x(&self, k: f64) -> f64 {
        self.left + self.pw * (k + 0.5) / self.n as f64
    }

    /// The y of `v` calls.
    fn y(&self, v: f64) -> f64 {
        self.top + self.ph * (1.0 - v / self.ymax)
    }

    /// The chart's opening, title, legend line, grid and axes.
    fn axes(&self, o: &mut String, title: &str, period: &str) {
        let (w, h, left, top, pw, ph) = (self.w, self.h, self.left, self.top, self.pw, self.ph);
        let _ = write!(
            o,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n\
             <text x=\"{left}\" y=\"24\" font-size=\"16\" font-weight=\"bold\">{}</text>\n\
             <text x=\"{left}\" y=\"42\" fill=\"#555\">solid: admitted per period · dashed: ceiling owed · dotted: floor owed · grey: tool capacity, thin grey: all callers · shaded: floors kept unused</text>\n",
            esc(title)
        );
        for i in 0..=self.ticks {
            let v = self.step * i as f64;
            let yy = self.y(v);
            let _ = writeln!(
                o,
                "<line x1=\"{left}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#eee\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{:.0}</text>",
                left + pw,
                left - 6.0,
                yy + 4.0,
                v
            );
        }
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">period ({period} each)</text>\
             <text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">calls admitted per period</text>",
            left + pw / 2.0,
            h - 12.0,
            top + ph / 2.0,
            top + ph / 2.0
        );
        for k in 0..self.n {
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                self.x(k as f64),
                top + ph + 16.0,
                k + 1
            );
        }
    }

    /// The tool's capacity, what it admitted in all, and the reserved floors each period left
    /// unused: shaded below the capacity, so the gap between the two reads as floors kept for
    /// tenants that did not call (never lent), not as capacity lost.
    fn capacity(&self, o: &mut String, report: &Report) {
        let (left, pw, capacity) = (self.left, self.pw, self.capacity);
        let _ = writeln!(
            o,
            "<line x1=\"{left}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\" stroke=\"#999\" stroke-width=\"2\"/><text x=\"{2:.1}\" y=\"{3:.1}\" fill=\"#666\">tool capacity {4}</text>",
            self.y(capacity),
            left + pw,
            left + 6.0,
            self.y(capacity) - 6.0,
            capacity
        );
        let half = pw / self.n as f64 / 2.0;
        for (k, p) in report.periods.iter().enumerate() {
            if p.unserved_floors > 0.0 {
                let top_y = self.y(capacity);
                let bottom_y = self.y((capacity - p.unserved_floors).max(0.0));
                let _ = writeln!(
                    o,
                    "<rect x=\"{:.1}\" y=\"{top_y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"#f0c36d\" opacity=\"0.35\"><title>floors kept unused: {}</title></rect>",
                    self.x(k as f64) - half,
                    2.0 * half,
                    bottom_y - top_y,
                    p.unserved_floors
                );
            }
        }
        let all = self.points(report, |p| p.admitted as f64);
        let _ = writeln!(
            o,
            "<polyline fill=\"none\" stroke=\"#777\" stroke-width=\"1\" points=\"{all}\"/>"
        );
        let kept = report
            .periods
            .iter()
            .map(|p| p.unserved_floors)
            .fold(0.0, f64::max);
        if kept > 0.0 {
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"#8a6d1f\" text-anchor=\"end\">shaded: up to {kept} a period kept for idle tenants' floors (reserved, never lent)</text>",
                left + pw - 6.0,
                self.y(capacity) + 16.0,
            );
        }
    }

    /// A line's points: `f` of each period.
    fn points(&self, report: &Report, f: impl Fn(&PeriodRow) -> f64) -> String {
        let points: Vec<String> = report
            .periods
            .iter()
            .enumerate()
            .map(|(k, p)| format!("{:.1},{:.1}", self.x(k as f64), self.y(f(p))))
            .collect();
        points.join(" ")
    }

    /// Caller `i`'s lines (its ceiling, floor and what it was admitted) and its legend entry.
    fn caller(&self, o: &mut String, report: &Report, i: usize) {
        let color = COLORS[i % COLORS.len()];
        let series = |f: fn(&CallerRow) -> f64| self.points(report, |p| f(&p.callers[i]));
        let _ = writeln!(
            o,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\" opacity=\"0.7\" points=\"{}\"/>",
            series(|c| c.ceiling)
        );
        let _ = writeln!(
            o,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" stroke-dasharray=\"2 3\" opacity=\"0.7\" points=\"{}\"/>",
            series(|c| c.floor)
        );
        let _ = writeln!(
            o,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"3\" points=\"{}\"/>",
            series(|c| c.admitted as f64)
        );
        let ly = self.top + 20.0 + 44.0 * i as f64;
        let lx = self.left + self.pw + 8.0;
        let t = &report.totals[i];
        let _ = writeln!(
            o,
            "<line x1=\"{lx:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"3\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>\
             <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#555\" font-size=\"10\">admitted {} of {} offered</text>",
            lx + 20.0,
            lx + 26.0,
            ly + 4.0,
            esc(&label(t)),
            lx + 26.0,
            ly + 18.0,
            t.admitted,
            t.offered
        );
    }
}
