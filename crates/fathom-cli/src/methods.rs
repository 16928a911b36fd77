//! The `--basis` flag; method lists are parsed by `fathom_bench::methods`.

use anyhow::Result;
use fathom_bench::calib::Calibration;
use fathom_bench::methods::{scanners, BasisChoice};
use fathom_plan::scanner::Scanner;

/// The basis Fathom methods use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BasisArg {
    /// Raw channels.
    Raw,
    /// Calibration KLT.
    Klt,
    /// The calibration's basis rule.
    Auto,
}

impl From<BasisArg> for BasisChoice {
    fn from(b: BasisArg) -> Self {
        match b {
            BasisArg::Raw => BasisChoice::Raw,
            BasisArg::Klt => BasisChoice::Klt,
            BasisArg::Auto => BasisChoice::Auto,
        }
    }
}

/// Parses a method list (the grammar of `fathom_plan::method`) into scanners.
pub fn parse_methods(
    list: &str,
    d: usize,
    basis: BasisArg,
    calib: Option<&Calibration>,
) -> Result<Vec<Box<dyn Scanner>>> {
    Ok(scanners(list, d, basis.into(), calib)?)
}
