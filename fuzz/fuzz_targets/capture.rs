//! Capture reader: `Capture::open` then `layer` for every layer, on arbitrary bytes.
#![no_main]

use fathom_bench::capture::Capture;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("fathom-fuzz-capture-{}", std::process::id()));
    std::fs::write(&path, data).expect("write the fuzz input");
    if let Ok(c) = Capture::open(&path) {
        let info = c.info().clone();
        assert!(info.hkv > 0 && info.hq % info.hkv == 0);
        assert!(info.positions.iter().all(|&p| p < info.n));
        for &l in &info.layers {
            if let Ok(ld) = c.layer(l) {
                assert_eq!(ld.k.len(), info.n * info.hkv * info.d);
                assert_eq!(ld.q.len(), info.positions.len() * info.hq * info.d);
                assert!(ld.q.iter().chain(&ld.k).chain(&ld.v).all(|x| x.is_finite()));
            }
        }
    }
});
