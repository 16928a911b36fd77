//! stub
pub use candle_core;
