//! Calibration reader: `Calibration::load` on arbitrary bytes (JSON).
#![no_main]

use fathom_bench::calib::Calibration;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("fathom-fuzz-calib-{}", std::process::id()));
    std::fs::write(&path, data).expect("write the fuzz input");
    if let Ok(c) = Calibration::load(&path) {
        for t in [24.0, 48.0, 64.0] {
            let _ = c.budgets_for(t);
        }
    }
});
