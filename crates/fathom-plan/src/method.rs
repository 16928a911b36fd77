//! One method grammar for every scan: the CPU scanners, the GPU step, the CLI and the
//! evaluation parse, print and classify methods here, and nowhere else (docs/SPEC.md §4).
//!
//! ```text
//! dense | exact | thumb2 | landmark | quest
//! fathom:B | fathom-layer:B | fathom-uniform:B | fathom-raw:B | fathom-klt:B | fathom-blockmax:B
//! sparq:R | sparq-union:R | ds:R | loki:R | loki-f16:R
//! fathom-sweep:B1-B2/STEP            (a list item only: fathom:B1, fathom:B1+STEP, …, ≤ B2;
//!                                     at most MAX_SWEEP = 10 000 budgets)
//! ```
//!
//! Ranges are checked at parse time against the head dimension `D`: a budget `B` is finite and
//! in `[0, 4.25·D]` (docs/SPEC.md §3's `max_budget`), a channel count `R` is in `1..=D`. So
//! `sparq:-3`, `sparq:0`, `fathom:-1` and `fathom:NaN` are errors where they were typed.
//!
//! A budget (and a sweep's ends and step) may be given per channel, `xc` = `x·D` bits
//! (docs/SPEC.md §4): `fathom:0.375c` is `fathom:48` at D = 128 and `fathom:24` at D = 64. It
//! resolves at parse time, so the method's label is the budget in bits.
//!
//! ```
//! use fathom_plan::method::{Family, MethodSpec};
//! let m: MethodSpec = MethodSpec::parse("ds:32", 128)?;
//! assert_eq!(m.to_string(), "ds:32");
//! assert_eq!(m.nominal_bits(128), 136.0);
//! assert!(m.is_136_bit_scan());
//! assert_eq!(m.family(), Family::DoubleSparsity);
//! assert!(MethodSpec::parse("sparq:-3", 128).is_err());
//! let list = MethodSpec::parse_list("exact,fathom-sweep:24-40/8,loki:16", 64)?;
//! let names: Vec<String> = list.iter().map(|m| m.to_string()).collect();
//! assert_eq!(names, ["exact", "fathom:24", "fathom:32", "fathom:40", "loki:16"]);
//! # Ok::<(), fathom_plan::method::MethodError>(())
//! ```

use std::fmt;

use crate::bits::max_budget;

/// A method string that does not parse, or whose argument is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("method {item:?}: {why}")]
pub struct MethodError {
    /// The list item as typed.
    pub item: String,
    /// What is wrong with it.
    pub why: String,
}

/// How a Fathom variant chooses its depths or basis (the ablations of docs/SPEC.md §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FathomVariant {
    /// Reverse water-filling at one budget, in the calibration's basis.
    Plan,
    /// Per-layer budgets from the calibration at a target mean.
    Layer,
    /// Uniform depth over the most important channels (ablation A4).
    Uniform,
    /// Water-filling in raw channels, whatever the calibration says.
    Raw,
    /// Water-filling in the KLT basis.
    Klt,
    /// Importance from the block maxima instead of σ² (raw channels).
    BlockMax,
}

impl FathomVariant {
    fn prefix(self) -> &'static str {
        match self {
            FathomVariant::Plan => "fathom",
            FathomVariant::Layer => "fathom-layer",
            FathomVariant::Uniform => "fathom-uniform",
            FathomVariant::Raw => "fathom-raw",
            FathomVariant::Klt => "fathom-klt",
            FathomVariant::BlockMax => "fathom-blockmax",
        }
    }
}

/// The scan family of a method, for grouping curves and tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Dense attention over every key (no scan).
    Dense,
    /// Exact top-k over the full-precision keys (the oracle).
    Exact,
    /// Fathom and its ablations.
    Fathom,
    /// SparQ and its union variant.
    SparQ,
    /// Double Sparsity.
    DoubleSparsity,
    /// Loki (4-bit or fp16 coordinates).
    Loki,
    /// All channels at 2 bits.
    Thumbnail,
    /// Block landmarks.
    Landmark,
    /// Quest pages.
    Quest,
}

/// A validated method.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MethodSpec {
    /// Dense attention.
    Dense,
    /// Exact top-k.
    Exact,
    /// Fathom at a budget (or target mean) of `budget` bits per token per KV head.
    Fathom {
        /// Which variant.
        variant: FathomVariant,
        /// Bits per token per KV head, in `[0, 4.25·D]`.
        budget: f32,
    },
    /// SparQ with `r` channels chosen per query group.
    SparQ {
        /// Channels, in `1..=D`.
        r: usize,
    },
    /// SparQ, channels chosen per query head and the union read.
    SparQUnion {
        /// Channels, in `1..=D`.
        r: usize,
    },
    /// Double Sparsity with `r` offline channels.
    DoubleSparsity {
        /// Channels, in `1..=D`.
        r: usize,
    },
    /// Loki with `r` PCA coordinates at 4 bits.
    Loki {
        /// Coordinates, in `1..=D`.
        r: usize,
    },
    /// Loki with `r` PCA coordinates in fp16.
    LokiF16 {
        /// Coordinates, in `1..=D`.
        r: usize,
    },
    /// All channels at 2 planes.
    Thumb2,
    /// fp16 mean key per 8-token block.
    Landmark,
    /// fp16 channel-wise min and max per 16-token page.
    Quest,
}

/// Every method name the grammar knows, for error messages and help.
pub const GRAMMAR: &str = "dense, exact, fathom:B, fathom-layer:B, fathom-uniform:B, \
fathom-sweep:B1-B2/STEP, fathom-raw:B, fathom-klt:B, fathom-blockmax:B, sparq:R, sparq-union:R, \
ds:R, loki:R, loki-f16:R, thumb2, landmark, quest (B in bits, or per channel as xc = x·D bits: \
fathom:0.375c)";

impl MethodSpec {
    /// Parses one method at head dimension `d` (`fathom-sweep` is a list item: see
    /// [`MethodSpec::parse_list`]).
    pub fn parse(item: &str, d: usize) -> Result<Self, MethodError> {
        let item = item.trim();
        let err = |why: String| MethodError {
            item: item.to_string(),
            why,
        };
        let (name, arg) = match item.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (item, None),
        };
        let need = |what: &str| -> Result<&str, MethodError> {
            match arg {
                Some(a) if !a.is_empty() => Ok(a),
                _ => Err(err(format!("needs {what}, e.g. {name}:32"))),
            }
        };
        let no_arg = |m: MethodSpec| -> Result<MethodSpec, MethodError> {
            match arg {
                None => Ok(m),
                Some(_) => Err(err(format!("{name} takes no argument"))),
            }
        };
        let r = || -> Result<usize, MethodError> {
            let s = need("a channel count R")?;
            let r: i64 = s
                .parse()
                .map_err(|_| err(format!("R = {s:?} is not an integer")))?;
            if r < 1 || r as u64 > d as u64 {
                return Err(err(format!("R = {r} is out of range 1..={d} (D = {d})")));
            }
            Ok(r as usize)
        };
        let fathom = |variant| -> Result<MethodSpec, MethodError> {
            let budget = parse_budget(need("a budget in bits")?, d).map_err(err)?;
            Ok(MethodSpec::Fathom { variant, budget })
        };
        match name {
            "dense" => no_arg(MethodSpec::Dense),
            "exact" => no_arg(MethodSpec::Exact),
            "thumb2" => no_arg(MethodSpec::Thumb2),
            "landmark" => no_arg(MethodSpec::Landmark),
            "quest" => no_arg(MethodSpec::Quest),
            "sparq" => Ok(MethodSpec::SparQ { r: r()? }),
            "sparq-union" => Ok(MethodSpec::SparQUnion { r: r()? }),
            "ds" | "double-sparsity" => Ok(MethodSpec::DoubleSparsity { r: r()? }),
            "loki" => Ok(MethodSpec::Loki { r: r()? }),
            "loki-f16" => Ok(MethodSpec::LokiF16 { r: r()? }),
            "fathom" => fathom(FathomVariant::Plan),
            "fathom-layer" => fathom(FathomVariant::Layer),
            "fathom-uniform" => fathom(FathomVariant::Uniform),
            "fathom-raw" => fathom(FathomVariant::Raw),
            "fathom-klt" => fathom(FathomVariant::Klt),
            "fathom-blockmax" => fathom(FathomVariant::BlockMax),
            "fathom-sweep" => Err(err(
                "fathom-sweep expands to several methods: use MethodSpec::parse_list".into(),
            )),
            _ => Err(err(format!("unknown method; expected one of {GRAMMAR}"))),
        }
    }

    /// Parses a comma-separated list, expanding `fathom-sweep:B1-B2/STEP` into `fathom:B` for
    /// `B = B1, B1 + STEP, …` up to `B2`. An empty list is an error, and so is a sweep of more
    /// than [`MAX_SWEEP`] budgets.
    pub fn parse_list(list: &str, d: usize) -> Result<Vec<Self>, MethodError> {
        let mut out = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.strip_prefix("fathom-sweep:") {
                Some(spec) => out.extend(parse_sweep(item, spec, d)?),
                None => out.push(Self::parse(item, d)?),
            }
        }
        if out.is_empty() {
            return Err(MethodError {
                item: list.to_string(),
                why: "the method list is empty".into(),
            });
        }
        Ok(out)
    }

    /// Nominal scan bits per token per KV head at `D` channels (docs/SPEC.md §4's convention:
    /// 4.25 bits per 4-bit channel with its fp16 block scale). Fathom's is its budget, an
    /// upper bound on what it reads; dense and exact read the full fp16 key.
    pub fn nominal_bits(&self, d: usize) -> f32 {
        let d = d as f32;
        match *self {
            MethodSpec::Dense | MethodSpec::Exact => 16.0 * d,
            MethodSpec::Fathom { budget, .. } => budget,
            MethodSpec::SparQ { r }
            | MethodSpec::SparQUnion { r }
            | MethodSpec::DoubleSparsity { r }
            | MethodSpec::Loki { r } => r as f32 * 4.25,
            MethodSpec::LokiF16 { r } => r as f32 * 16.0,
            MethodSpec::Thumb2 => 2.25 * d,
            MethodSpec::Landmark => 16.0 * d / 8.0,
            MethodSpec::Quest => 2.0 * 16.0 * d / 16.0,
        }
    }

    /// Bits per token per KV head that the method's index keeps (what a scan may read, as
    /// opposed to what one scan does read): the 4-bit bit-plane store for Fathom and SparQ
    /// (4.25·D), the label cache or coordinates for Double Sparsity and Loki (4.25·r, 16·r in
    /// fp16), the 2-plane thumbnail (2.25·D), one fp16 key per 8 tokens for landmarks and
    /// two per 16 for Quest (2·D), the fp16 keys themselves for exact and dense (16·D).
    pub fn index_bits(&self, d: usize) -> f32 {
        let d = d as f32;
        match *self {
            MethodSpec::Fathom { .. }
            | MethodSpec::SparQ { .. }
            | MethodSpec::SparQUnion { .. } => 4.25 * d,
            MethodSpec::DoubleSparsity { r } | MethodSpec::Loki { r } => 4.25 * r as f32,
            MethodSpec::LokiF16 { r } => 16.0 * r as f32,
            MethodSpec::Thumb2 => 2.25 * d,
            MethodSpec::Landmark | MethodSpec::Quest => 2.0 * d,
            MethodSpec::Dense | MethodSpec::Exact => 16.0 * d,
        }
    }

    /// The family.
    pub fn family(&self) -> Family {
        match self {
            MethodSpec::Dense => Family::Dense,
            MethodSpec::Exact => Family::Exact,
            MethodSpec::Fathom { .. } => Family::Fathom,
            MethodSpec::SparQ { .. } | MethodSpec::SparQUnion { .. } => Family::SparQ,
            MethodSpec::DoubleSparsity { .. } => Family::DoubleSparsity,
            MethodSpec::Loki { .. } | MethodSpec::LokiF16 { .. } => Family::Loki,
            MethodSpec::Thumb2 => Family::Thumbnail,
            MethodSpec::Landmark => Family::Landmark,
            MethodSpec::Quest => Family::Quest,
        }
    }

    /// Whether this is one of the paper's 136-bit per-token scans: SparQ, Double Sparsity or
    /// Loki at r = 32 coordinates of 4.25 bits (docs/SPEC.md §4), whatever `D` is.
    pub fn is_136_bit_scan(&self) -> bool {
        matches!(
            self,
            MethodSpec::SparQ { r: 32 }
                | MethodSpec::DoubleSparsity { r: 32 }
                | MethodSpec::Loki { r: 32 }
        )
    }

    /// Whether the method scores every token from a cheap form of its key (the paper's
    /// per-token scans: Fathom, SparQ, Double Sparsity, Loki and the 2-bit thumbnail), as
    /// opposed to scoring blocks of tokens (landmark, Quest) or reading whole keys (dense,
    /// exact). Claim 5 (docs/SPEC.md §7) is about these.
    pub fn is_per_token_scan(&self) -> bool {
        !matches!(
            self,
            MethodSpec::Dense | MethodSpec::Exact | MethodSpec::Landmark | MethodSpec::Quest
        )
    }

    /// Loki's coordinate count, for either precision.
    pub fn loki_r(&self) -> Option<usize> {
        match *self {
            MethodSpec::Loki { r } | MethodSpec::LokiF16 { r } => Some(r),
            _ => None,
        }
    }

    /// Whether the method needs a calibration (σ², a basis or offline channels).
    pub fn needs_calibration(&self) -> bool {
        !matches!(
            self,
            MethodSpec::Dense
                | MethodSpec::Exact
                | MethodSpec::SparQ { .. }
                | MethodSpec::SparQUnion { .. }
                | MethodSpec::Thumb2
                | MethodSpec::Landmark
                | MethodSpec::Quest
        )
    }
}

impl fmt::Display for MethodSpec {
    /// The canonical label, which [`MethodSpec::parse`] reads back to the same method.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            MethodSpec::Dense => f.write_str("dense"),
            MethodSpec::Exact => f.write_str("exact"),
            MethodSpec::Fathom { variant, budget } => {
                write!(f, "{}:{}", variant.prefix(), fmt_budget(budget))
            }
            MethodSpec::SparQ { r } => write!(f, "sparq:{r}"),
            MethodSpec::SparQUnion { r } => write!(f, "sparq-union:{r}"),
            MethodSpec::DoubleSparsity { r } => write!(f, "ds:{r}"),
            MethodSpec::Loki { r } => write!(f, "loki:{r}"),
            MethodSpec::LokiF16 { r } => write!(f, "loki-f16:{r}"),
            MethodSpec::Thumb2 => f.write_str("thumb2"),
            MethodSpec::Landmark => f.write_str("landmark"),
            MethodSpec::Quest => f.write_str("quest"),
        }
    }
}

/// A budget without trailing zeros (`48`, `47.5`).
pub fn fmt_budget(b: f32) -> String {
    if b.fract() == 0.0 && b.abs() < 1e9 {
        format!("{}", b as i64)
    } else {
        format!("{b}")
    }
}

/// Bits from `B` (bits) or `xc` (`x` bits per channel: `B = x·D`, docs/SPEC.md §4), not yet
/// range-checked. The one rule for budgets, sweep ends and sweep steps.
fn parse_bits(s: &str, d: usize, what: &str) -> Result<f32, String> {
    let (num, per_channel) = match s.strip_suffix('c') {
        Some(x) => (x, true),
        None => (s, false),
    };
    let x: f32 = num.parse().map_err(|_| {
        format!("{what} {s:?} is not a number of bits (48) or of bits per channel (0.375c)")
    })?;
    if per_channel && !x.is_finite() {
        return Err(format!("{what} {s:?}: {x} bits per channel is not finite"));
    }
    Ok(if per_channel { x * d as f32 } else { x })
}

fn parse_budget(s: &str, d: usize) -> Result<f32, String> {
    let b = parse_bits(s, d, "budget")?;
    let max = max_budget(d);
    if !b.is_finite() || !(0.0..=max).contains(&b) {
        let per = if s.ends_with('c') {
            format!(" ({s} at D = {d})")
        } else {
            String::new()
        };
        return Err(format!(
            "budget {b} bits{per} is out of range [0, {max}] (4.25 × D, D = {d}; per channel [0, 4.25]c)"
        ));
    }
    Ok(b)
}

/// The most budgets one `fathom-sweep:B1-B2/STEP` item may expand to.
pub const MAX_SWEEP: usize = 10_000;

fn parse_sweep(item: &str, spec: &str, d: usize) -> Result<Vec<MethodSpec>, MethodError> {
    let err = |why: String| MethodError {
        item: item.to_string(),
        why,
    };
    let shape = || err("expected fathom-sweep:B1-B2/STEP, e.g. fathom-sweep:24-136/8".into());
    let (range, step) = spec.split_once('/').ok_or_else(shape)?;
    let (b1, b2) = range.split_once('-').ok_or_else(shape)?;
    let (b1, b2) = (
        parse_budget(b1, d).map_err(err)?,
        parse_budget(b2, d).map_err(err)?,
    );
    let step = parse_bits(step, d, "STEP").map_err(err)?;
    if !(step.is_finite() && step > 0.0) || b2 < b1 {
        return Err(err(format!(
            "need B1 ≤ B2 and STEP > 0 (got {b1}-{b2}/{step})"
        )));
    }
    // In f64, so a tiny STEP neither saturates the cast nor wraps the `+ 1`; a sweep longer
    // than MAX_SWEEP is refused rather than allocated.
    let n = ((f64::from(b2) - f64::from(b1)) / f64::from(step) + 1e-4).floor() + 1.0;
    if n > MAX_SWEEP as f64 {
        return Err(err(format!(
            "{b1}-{b2}/{step} is {n} budgets, more than the {MAX_SWEEP} a sweep may hold"
        )));
    }
    let n = n as usize;
    Ok((0..n)
        .map(|i| MethodSpec::Fathom {
            variant: FathomVariant::Plan,
            budget: b1 + i as f32 * step,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_label_parses_back_to_itself() {
        for d in [32usize, 64, 128, 256] {
            let list =
                "dense,exact,thumb2,landmark,quest,fathom:48,fathom-layer:64,fathom-uniform:47.5,\
                        fathom-raw:0,fathom-klt:92,fathom-blockmax:24,sparq:16,sparq-union:8,ds:1,\
                        loki:16,loki-f16:4";
            for m in MethodSpec::parse_list(list, d).unwrap() {
                let back = MethodSpec::parse(&m.to_string(), d).unwrap();
                assert_eq!(back, m, "{m} at D = {d}");
            }
        }
    }

    #[test]
    fn out_of_range_arguments_fail_at_parse_time() {
        for bad in [
            "sparq:-3",
            "sparq:0",
            "sparq:65",
            "ds:1.5",
            "loki:",
            "loki",
            "fathom:-1",
            "fathom:NaN",
            "fathom:inf",
            "fathom:273",
            "fathom",
            "exact:3",
            "nope:1",
            "fathom-sweep:24-136",
            "fathom-sweep:48-24/8",
            "fathom-sweep:24-48/0",
            "fathom-sweep:24-48/-8",
            // A STEP so small the budget count saturates or wraps a usize, or is merely huge.
            "fathom-sweep:0-272/1e-40",
            "fathom-sweep:0-272/1e-30",
            "fathom-sweep:0-272/0.01",
        ] {
            let e = MethodSpec::parse_list(bad, 64).unwrap_err();
            assert_eq!(e.item, bad, "{e}");
        }
        assert!(
            MethodSpec::parse("fathom:272", 64).is_ok(),
            "4.25 × 64 is the maximum"
        );
        assert!(MethodSpec::parse_list(" , ", 64).is_err());
    }

    #[test]
    fn bits_family_and_the_136_bit_rule() {
        let d = 128;
        let p = |s: &str| MethodSpec::parse(s, d).unwrap();
        assert_eq!(p("sparq:32").nominal_bits(d), 136.0);
        assert_eq!(p("sparq:16").nominal_bits(d), 68.0);
        assert_eq!(p("thumb2").nominal_bits(d), 288.0);
        assert_eq!(p("landmark").nominal_bits(d), 256.0);
        assert_eq!(p("quest").nominal_bits(d), 256.0);
        assert_eq!(p("fathom:48").nominal_bits(d), 48.0);
        for s in ["sparq:32", "ds:32", "loki:32"] {
            assert!(p(s).is_136_bit_scan(), "{s}");
        }
        for s in [
            "sparq:16",
            "sparq-union:32",
            "loki-f16:32",
            "fathom:136",
            "ds:31",
        ] {
            assert!(!p(s).is_136_bit_scan(), "{s}");
        }
        for s in [
            "fathom:48",
            "sparq:16",
            "ds:32",
            "loki:16",
            "loki-f16:8",
            "thumb2",
        ] {
            assert!(p(s).is_per_token_scan(), "{s}");
        }
        for s in ["dense", "exact", "landmark", "quest"] {
            assert!(!p(s).is_per_token_scan(), "{s}");
        }
        assert_eq!(p("sparq-union:8").family(), Family::SparQ);
        assert_eq!(p("loki-f16:8").loki_r(), Some(8));
        assert_eq!(p("ds:8").loki_r(), None);
    }

    /// `xc` is `x·D` bits for every Fathom form, checked as bits are; a malformed one names
    /// the item and the problem.
    #[test]
    fn budgets_per_channel() {
        let p = |s: &str, d| MethodSpec::parse(s, d).map(|m| m.to_string());
        assert_eq!(p("fathom:0.375c", 128).unwrap(), "fathom:48");
        assert_eq!(p("fathom:0.375c", 64).unwrap(), "fathom:24");
        assert_eq!(p("fathom:0.375c", 256).unwrap(), "fathom:96");
        assert_eq!(p("fathom-layer:0.5c", 64).unwrap(), "fathom-layer:32");
        assert_eq!(p("fathom:4.25c", 64).unwrap(), "fathom:272");
        let v = MethodSpec::parse_list("fathom-sweep:0.25c-0.5c/0.125c", 128).unwrap();
        let names: Vec<String> = v.iter().map(|m| m.to_string()).collect();
        assert_eq!(names, ["fathom:32", "fathom:48", "fathom:64"]);
        for (bad, says) in [
            ("fathom:4.5c", "per channel [0, 4.25]c"),
            ("fathom:-0.1c", "out of range"),
            ("fathom:c", "not a number"),
            ("fathom:0.3cc", "not a number"),
            ("fathom:infc", "not finite"),
            ("fathom-sweep:0.1c-0.2c/0c", "STEP > 0"),
        ] {
            let e = MethodSpec::parse_list(bad, 64).unwrap_err();
            assert_eq!(e.item, bad);
            assert!(e.why.contains(says), "{bad}: {e}");
        }
        assert!(
            MethodSpec::parse("sparq:0.25c", 64).is_err(),
            "R stays a count"
        );
    }

    /// Seeded property: at every D, `fathom:xc` parses to the budget `x·D` exactly when `x·D`
    /// parses as bits, and to the same method.
    #[test]
    fn per_channel_equals_bits_times_d() {
        use crate::testutil::runner;
        use proptest::prelude::*;
        for d in [32usize, 64, 128, 256] {
            runner(200)
                .run(&(0u32..=4400), |x| {
                    let x = x as f32 / 1000.0;
                    let per = MethodSpec::parse(&format!("fathom:{x}c"), d);
                    let bits = MethodSpec::parse(&format!("fathom:{}", x * d as f32), d);
                    prop_assert_eq!(per.ok(), bits.ok());
                    Ok(())
                })
                .unwrap();
        }
    }

    #[test]
    fn sweeps_include_both_ends_on_the_grid() {
        let v = MethodSpec::parse_list("fathom-sweep:24-136/8", 128).unwrap();
        assert_eq!(v.len(), 15);
        assert_eq!(v[14].to_string(), "fathom:136");
        let v = MethodSpec::parse_list("fathom-sweep:24-30/8", 128).unwrap();
        assert_eq!(v.len(), 1);
        // The largest sweep allowed, and one past it.
        let v = MethodSpec::parse_list("fathom-sweep:0-4999.5/0.5", 2048).unwrap();
        assert_eq!(v.len(), MAX_SWEEP);
        assert_eq!(v[MAX_SWEEP - 1].to_string(), "fathom:4999.5");
        assert!(MethodSpec::parse_list("fathom-sweep:0-5000/0.5", 2048).is_err());
    }
}
