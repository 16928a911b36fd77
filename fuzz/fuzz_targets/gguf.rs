//! GGUF metadata path of `Model::load`: `gguf_file::Content::read`, `Config::from_gguf` and
//! `Tokenizer::from_gguf`, on arbitrary bytes (through the same pre-check `Model::load` uses).
#![no_main]

use fathom_model::{Config, Tokenizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(content) = fathom_model::model::read_gguf(&mut std::io::Cursor::new(data))
    else {
        return;
    };
    let _ = Config::from_gguf(&content);
    if let Ok(t) = Tokenizer::from_gguf(&content) {
        if let Ok(ids) = t.encode("Hello, world") {
            let _ = t.decode(&ids);
        }
    }
});
