//! RULER-style synthetic tasks over real-text haystacks, reimplemented from the public
//! generation rules of NVIDIA/RULER (`scripts/data/synthetic/`: `niah.py`,
//! `variable_tracking.py`, `freq_words_extraction.py`).
//!
//! | task | RULER config | what is planted | gold |
//! |---|---|---|---|
//! | `niah_single` | `niah_single_2` (essay haystack, word key, number value) | 1 needle | its value |
//! | `niah_multikey` | `niah_multikey_1` | 4 needles, distinct keys | the queried key's value |
//! | `niah_multivalue` | `niah_multivalue` | 4 needles, one key | all 4 values |
//! | `niah_multiquery` | `niah_multiquery` | 4 needles, distinct keys | all 4 values |
//! | `vt` | `vt` (1 chain, 4 hops) | `VAR ABCDE = 12345`, then `VAR X = VAR Y` ×4, in order | the 5 names |
//! | `fwe` | `fwe` (α = 2) | coded 6-letter words, Zipf counts | words of rank 2–4 |
//!
//! Needles read `One of the special magic numbers for {key} is: {value}.`, keys are
//! adjective-noun pairs from [`WordList`](crate::words::WordList), values 7-digit numbers;
//! each needle goes at a depth drawn without replacement from RULER's 40 evenly spaced
//! depths (0–100 %), at a sentence boundary. Question templates and answer prefixes are
//! RULER's (the prompt ends with the answer prefix, so the model continues it).
//!
//! **Haystacks** are real text: the words of the project's prose corpus (Python documentation,
//! held-out split), from a seeded offset; `vt` uses the same real text as its filler (RULER's
//! default filler is a repeated sentence; the chain is still inserted in order at random
//! sentence boundaries). `fwe` has no haystack by construction.
//!
//! **Sizing** is RULER's: the haystack (words, or coded words for `fwe`) is the largest that
//! keeps the whole prompt within `context − tokens_to_generate` tokens of the model's own
//! tokenizer (binary search on the word count; RULER searches in steps). `vt` opens with
//! RULER's in-context example, as RULER's `add_fewshot` default does: the same template over a
//! few hundred tokens of the haystack with a 3-letter chain, and its answer
//! ([`TaskParams::vt_example`]; results made before it record `vt_example` absent), and its
//! haystack is RULER's line of noise repeated ([`TaskParams::vt_noise`], [`VT_NOISE`]: RULER's
//! `variable_tracking.py` has no other; results made before it record `vt_haystack` absent and
//! used the real-text haystack, as the NIAH tasks still do). `fwe` has no
//! example (RULER's `freq_words_extraction.py` adds none by default).
//!
//! **Departures for small models** (both off by default, both recorded in a result): the
//! [`PromptFormat::Chat`] wording puts the task in the model's chat turn and says "number … is"
//! when one value is asked for; the [`TaskShape::SMALL`] counts plant 2 keys (multikey,
//! multiquery) and 2 values (multivalue) instead of 4, and a `vt` chain of 2 variables (1 hop)
//! instead of 5 (4 hops), with the answer prefix's count to match. Templates, needle
//! sentences, depths, sizing and scoring stay RULER's. Two more, also off by default and
//! recorded: [`Needle::Passkey`] (`--shape …,needle=passkey`) words the NIAH needles as
//! numeric pass keys stated twice, with a matching question and answer prefix;
//! [`AnswerForm::Lines`] (`--shape …,answer=lines`) ends the answer prefix of a task of several
//! gold values with the first line of a list, worded as the needle (`… are:\n- The pass key for
//! {key} is`), so that a model that lists values lists them as the needles state them; and
//! [`Haystack::prose_only`] (`fathom ruler --haystack prose`) keeps only the haystack's
//! running-prose words; [`TaskParams::niah_noise`] (`--haystack noise`) plants the NIAH
//! needles between lines of RULER's noise ([`VT_NOISE`]), the haystack of RULER's
//! `niah_single_1`, instead of the real text.
//!
//! Everything is drawn from one [`StdRng`](rand::rngs::StdRng) seeded per (task, sample), so
//! a seed fixes the prompt exactly. **Score** (RULER's `string_match_all`): the fraction of gold strings that
//! occur in the generation, case-insensitively.

use serde::Serialize;

use crate::EvalError;

mod generate;
mod orchestrate;
pub use generate::{generate, VT_EXAMPLE_TOKENS, VT_NOISE};
pub use orchestrate::{
    run, MethodGeneration, MethodScore, RulerPlan, RulerRun, SampleRun, TaskRun,
};

/// A task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// One needle.
    NiahSingle,
    /// Four keys, one queried.
    NiahMultikey,
    /// One key, four values.
    NiahMultivalue,
    /// Four keys, all queried.
    NiahMultiquery,
    /// Variable tracking.
    Vt,
    /// Frequent-word extraction.
    Fwe,
}

impl Task {
    /// Every task, in the table's order.
    pub const ALL: [Task; 6] = [
        Task::NiahSingle,
        Task::NiahMultikey,
        Task::NiahMultivalue,
        Task::NiahMultiquery,
        Task::Vt,
        Task::Fwe,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Task::NiahSingle => "niah_single",
            Task::NiahMultikey => "niah_multikey",
            Task::NiahMultivalue => "niah_multivalue",
            Task::NiahMultiquery => "niah_multiquery",
            Task::Vt => "vt",
            Task::Fwe => "fwe",
        }
    }

    /// RULER's `tokens_to_generate`.
    pub fn tokens_to_generate(self) -> usize {
        match self {
            Task::Vt => 30,
            Task::Fwe => 50,
            _ => 128,
        }
    }

    fn index(self) -> u64 {
        Task::ALL.iter().position(|t| *t == self).unwrap_or(0) as u64
    }
}

impl std::str::FromStr for Task {
    type Err = EvalError;
    fn from_str(s: &str) -> Result<Self, EvalError> {
        Task::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                EvalError::Invalid(format!(
                    "unknown task {s:?}; expected one of {}",
                    Task::ALL.map(|t| t.name()).join(", ")
                ))
            })
    }
}

/// How much each task plants: RULER's counts, or fewer for small models (item 5 of the
/// downstream issue: the tasks keep RULER's structure, templates and scoring; only these
/// counts change, and a result records which it used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TaskShape {
    /// Keys planted in `niah_multikey` (one queried) and `niah_multiquery` (all queried).
    pub keys: usize,
    /// Values planted for the key of `niah_multivalue`.
    pub values: usize,
    /// Variables in `vt`'s chain (the first assigned the value, each next one the previous).
    pub chain: usize,
    /// Digits of a NIAH needle's value (RULER: 7; `vt`'s value keeps RULER's 5 digits).
    pub digits: u32,
    /// The NIAH needle's wording (RULER: [`Needle::Magic`]).
    pub needle: Needle,
    /// How the answer prefix of a NIAH task with several gold values ends (RULER:
    /// [`AnswerForm::Ruler`]).
    pub answer: AnswerForm,
}

/// How the answer prefix of a NIAH task with several gold values (`niah_multivalue`,
/// `niah_multiquery`) ends. A task of one gold value keeps its prefix either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AnswerForm {
    /// RULER's: the prefix ends at "… are", and the model words the list.
    #[default]
    Ruler,
    /// The prefix opens a list of one value per line, each line worded as the needle states
    /// it: `… are:\n- The pass key for {first queried key} is` (or RULER's needle's
    /// `One of the special magic numbers for {key} is:`). It names no value: the model must
    /// still retrieve every value, and write the later lines itself.
    Lines,
}

/// How a NIAH needle, its question and its answer prefix are worded. The structure (keys,
/// values, depths, queries, gold, scoring) is the same for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Needle {
    /// RULER's: `One of the special magic numbers for {key} is: {value}.`, asked as "What
    /// are all the special magic numbers for {query} mentioned in the provided text?".
    #[default]
    Magic,
    /// The numeric pass key of the passkey-retrieval test (Mohtashami and Jaggi, 2023), keyed
    /// as RULER's needles are: `The pass key for {key} is {value}. Remember it. {value} is the
    /// pass key for {key}.`, asked as "What is the pass key for {query}?" (plural for several
    /// keys or values). The value is stated twice, so a small model finds it more easily.
    Passkey,
}

impl Needle {
    /// The needle sentence for `key` and `value`.
    pub fn sentence(self, key: &str, value: &str) -> String {
        match self {
            Needle::Magic => needle(key, value),
            Needle::Passkey => format!(
                "The pass key for {key} is {value}. Remember it. {value} is the pass key for {key}."
            ),
        }
    }

    /// The task template (with `{context}` and `{query}`) and the answer prefix (with
    /// `{query}`) for `values` gold values, under `format`.
    fn template(self, format: &PromptFormat, values: usize) -> (&'static str, &'static str) {
        match self {
            Needle::Magic => (
                NIAH_TEMPLATE,
                match (format, values) {
                    (PromptFormat::Chat(_), 1) => NIAH_ANSWER_ONE,
                    _ => NIAH_ANSWER,
                },
            ),
            Needle::Passkey if values == 1 => (PASSKEY_TEMPLATE_ONE, PASSKEY_ANSWER_ONE),
            Needle::Passkey => (PASSKEY_TEMPLATE, PASSKEY_ANSWER),
        }
    }

    /// The needle sentence for `key` up to its value: what an [`AnswerForm::Lines`] line
    /// opens with.
    pub fn lead(self, key: &str) -> String {
        match self {
            Needle::Magic => format!("One of the special magic numbers for {key} is:"),
            Needle::Passkey => format!("The pass key for {key} is"),
        }
    }
}

impl AnswerForm {
    /// `answer`, the answer prefix of a NIAH task (its `{query}` filled in), for `values`
    /// gold values whose first queried key is `first`, under `needle`.
    pub fn finish(self, answer: String, values: usize, needle: Needle, first: &str) -> String {
        match self {
            AnswerForm::Lines if values > 1 => format!("{answer}:\n- {}", needle.lead(first)),
            _ => answer,
        }
    }
}

impl TaskShape {
    /// RULER's counts: 4 keys, 4 values, a chain of 5, 7-digit values.
    pub const RULER: TaskShape = TaskShape {
        keys: 4,
        values: 4,
        chain: 5,
        digits: 7,
        needle: Needle::Magic,
        answer: AnswerForm::Ruler,
    };
    /// For 100M-parameter models: 2 keys, 2 values, a chain of 2, 7-digit values.
    pub const SMALL: TaskShape = TaskShape {
        keys: 2,
        values: 2,
        chain: 2,
        digits: 7,
        needle: Needle::Magic,
        answer: AnswerForm::Ruler,
    };

    /// `ruler`, `small`, or either followed by overrides, `small,digits=4,keys=3` (a bare
    /// list of overrides starts from `ruler`): `keys` and `values` in 1..=16, `chain` in
    /// 1..=10, `digits` in 1..=9, `needle` `magic` or `passkey`, `answer` `ruler` or `lines`.
    pub fn parse(s: &str) -> Result<TaskShape, EvalError> {
        let bad = |what: String| {
            EvalError::Invalid(format!(
                "task shape {s:?}: {what}; expected ruler, small, or one of them followed by keys=K, values=V, chain=C, digits=D, needle=magic|passkey, answer=ruler|lines"
            ))
        };
        let mut parts = s.split(',').map(str::trim).peekable();
        let mut shape = match parts.peek() {
            Some(&"ruler") => {
                parts.next();
                TaskShape::RULER
            }
            Some(&"small") => {
                parts.next();
                TaskShape::SMALL
            }
            _ => TaskShape::RULER,
        };
        let mut any = false;
        for p in parts {
            any = true;
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| bad(format!("{p:?} is not name=value")))?;
            if k.trim() == "needle" {
                shape.needle = match v.trim() {
                    "magic" => Needle::Magic,
                    "passkey" => Needle::Passkey,
                    other => return Err(bad(format!("needle={other} (want magic or passkey)"))),
                };
                continue;
            }
            if k.trim() == "answer" {
                shape.answer = match v.trim() {
                    "ruler" => AnswerForm::Ruler,
                    "lines" => AnswerForm::Lines,
                    other => return Err(bad(format!("answer={other} (want ruler or lines)"))),
                };
                continue;
            }
            let n: usize = v
                .trim()
                .parse()
                .map_err(|_| bad(format!("{v:?} is not a count")))?;
            let (field, hi) = match k.trim() {
                "keys" => (&mut shape.keys, 16),
                "values" => (&mut shape.values, 16),
                "chain" => (&mut shape.chain, 10),
                "digits" => {
                    if !(1..=9).contains(&n) {
                        return Err(bad(format!("digits={n} (want 1..=9)")));
                    }
                    shape.digits = n as u32;
                    continue;
                }
                other => return Err(bad(format!("unknown count {other:?}"))),
            };
            if !(1..=hi).contains(&n) {
                return Err(bad(format!("{k}={n} (want 1..={hi})")));
            }
            *field = n;
        }
        if !any && !matches!(s.trim(), "ruler" | "small") {
            return Err(bad("unknown name".into()));
        }
        Ok(shape)
    }

    /// The label a result records: `ruler`, or the counts that differ from RULER's.
    pub fn label(&self) -> String {
        if *self == TaskShape::RULER {
            return "ruler".into();
        }
        let needle = match self.needle {
            Needle::Magic => "",
            Needle::Passkey => ", passkey needles",
        };
        let answer = match self.answer {
            AnswerForm::Ruler => "",
            AnswerForm::Lines => ", answers as needle lines",
        };
        format!(
            "keys {}, values {}, chain {}, digits {}{needle}{answer} (RULER: 4, 4, 5, 7)",
            self.keys, self.values, self.chain, self.digits
        )
    }
}

impl Default for TaskShape {
    fn default() -> Self {
        TaskShape::RULER
    }
}

/// Generation parameters.
#[derive(Debug, Clone)]
pub struct TaskParams {
    /// Context length in tokens (prompt + tokens to generate).
    pub context: usize,
    /// Tokens to generate (and reserved by the sizing); `None` means RULER's per task.
    pub tokens_to_generate: Option<usize>,
    /// Base seed; a sample's seed mixes it with the task and sample index.
    pub seed: u64,
    /// How the prompt is worded around RULER's structure.
    pub format: PromptFormat,
    /// How much each task plants.
    pub shape: TaskShape,
    /// Prepend RULER's in-context example to `vt` (its `add_fewshot`, on by default there and
    /// here): a short chain over a few hundred tokens of the same haystack, with its answer.
    pub vt_example: bool,
    /// `vt`'s haystack is RULER's: its noise line ([`VT_NOISE`]) repeated, the only haystack
    /// RULER's `variable_tracking.py` has. `false`: the run's real-text haystack, as runs made
    /// before this field did (they record `vt_haystack` absent). The NIAH tasks read the
    /// real-text haystack unless [`TaskParams::niah_noise`].
    pub vt_noise: bool,
    /// The NIAH tasks' haystack is RULER's noise too ([`VT_NOISE`] repeated, the
    /// `type_haystack: noise` of RULER's `niah_single_1`), not the real text: off by default
    /// (results made before it record `niah_haystack` absent and read the real text).
    pub niah_noise: bool,
}

impl TaskParams {
    /// RULER's defaults at `context` tokens, seed 0.
    pub fn new(context: usize) -> Self {
        TaskParams {
            context,
            tokens_to_generate: None,
            seed: 0,
            format: PromptFormat::Ruler,
            shape: TaskShape::RULER,
            vt_example: true,
            vt_noise: true,
            niah_noise: false,
        }
    }
}

/// A model's chat turn: the text before the user's message and between it and the
/// assistant's answer (control tokens written as text; the tokenizer recognises them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTurn {
    /// Before the user's message (`<|im_start|>user\n`).
    pub user: String,
    /// After it, opening the assistant's turn (`<|im_end|>\n<|im_start|>assistant\n`).
    pub assistant: String,
}

impl ChatTurn {
    /// The chat turn of a model by its fathom name: SmolLM2-Instruct's ChatML and Gemma 3's
    /// turns; `None` for another model.
    pub fn for_model(name: &str) -> Option<ChatTurn> {
        let (user, assistant) = match name {
            "smollm2-135m" => ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
            "gemma3-270m" => (
                "<start_of_turn>user\n",
                "<end_of_turn>\n<start_of_turn>model\n",
            ),
            _ => return None,
        };
        Some(ChatTurn {
            user: user.into(),
            assistant: assistant.into(),
        })
    }
}

/// How a prompt is worded. The structure (haystack, needles, depths, question, gold, sizing)
/// is RULER's either way.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PromptFormat {
    /// RULER's templates verbatim: the question, then the answer prefix, as plain text.
    #[default]
    Ruler,
    /// For small instruction-tuned models: the task inside the model's chat turn, with the
    /// answer prefix opening the assistant's reply; and the NIAH answer prefix in the singular
    /// when one value is asked for ("The special magic number for K mentioned in the provided
    /// text is"), where RULER's plural ("numbers … are") makes small models start a list.
    Chat(ChatTurn),
}

impl PromptFormat {
    /// `text` (a template with its question) and `answer` (the answer prefix) as the model
    /// reads them.
    fn wrap(&self, text: &str, answer: &str) -> String {
        match self {
            PromptFormat::Ruler => format!("{text}{answer}"),
            PromptFormat::Chat(c) => {
                format!("{}{text}{}{}", c.user, c.assistant, answer.trim_start())
            }
        }
    }
}

/// The real text needles are hidden in: whitespace-separated words, in corpus order.
#[derive(Debug, Clone)]
pub struct Haystack {
    words: Vec<String>,
    /// Where it came from.
    pub source: String,
}

impl Haystack {
    /// From documents' texts, joined in order.
    pub fn new<'a>(texts: impl Iterator<Item = &'a str>, source: &str) -> Result<Self, EvalError> {
        let words: Vec<String> = texts
            .flat_map(|t| t.split_whitespace())
            .map(str::to_string)
            .collect();
        if words.len() < 1000 {
            return Err(EvalError::Invalid(format!(
                "haystack {source}: only {} words",
                words.len()
            )));
        }
        Ok(Haystack {
            words,
            source: source.into(),
        })
    }

    /// The words that read as running prose: markup, identifiers and numbers dropped. A word
    /// is kept when, without its leading `("'` and trailing `.,;:?!)"'`, it is letters,
    /// apostrophes and hyphens only (so no `_`, inner `.`, backquote, digit or `=`), and it
    /// does not end in `::` (a reST directive). Built for small
    /// models, which take a documentation haystack's code names (`DJANGO_SETTINGS_MODULE`,
    /// ``:attr:`…` ``) for the answer; RULER's own haystack (essays) is plain prose.
    ///
    /// # Errors
    /// [`EvalError::Invalid`] when fewer than 1000 words remain.
    pub fn prose_only(&self) -> Result<Haystack, EvalError> {
        let keep = |w: &str| {
            let core = w
                .trim_start_matches(|c| "(\"'".contains(c))
                .trim_end_matches(|c| ".,;:?!)\"'".contains(c));
            !core.is_empty()
                && core.chars().any(char::is_alphabetic)
                && core
                    .chars()
                    .all(|c| c.is_alphabetic() || c == '\'' || c == '-')
                && !w.ends_with("::")
        };
        let words: Vec<String> = self.words.iter().filter(|w| keep(w)).cloned().collect();
        if words.len() < 1000 {
            return Err(EvalError::Invalid(format!(
                "haystack {} (prose only): only {} words",
                self.source,
                words.len()
            )));
        }
        Ok(Haystack {
            words,
            source: format!("{} (prose words only)", self.source),
        })
    }

    /// `m` words from `start` on, wrapping around.
    fn take(&self, start: usize, m: usize) -> impl Iterator<Item = &str> {
        let n = self.words.len();
        (0..m).map(move |i| self.words[(start + i) % n].as_str())
    }
}

/// One generated prompt.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Task.
    pub task: Task,
    /// Sample index.
    pub index: usize,
    /// The seed it was drawn with.
    pub seed: u64,
    /// The prompt text (ends with the answer prefix).
    #[serde(skip)]
    pub prompt: String,
    /// Its tokens (BOS included when the model adds one).
    #[serde(skip)]
    pub prompt_ids: Vec<u32>,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens to generate.
    pub max_new: usize,
    /// Gold strings.
    pub gold: Vec<String>,
    /// The question part (after the haystack), for readers.
    pub question: String,
    /// Haystack words used, and the word offset they start at (`vt` on RULER's noise
    /// haystack: lines of [`VT_NOISE`], offset 0).
    pub haystack_words: usize,
    /// Offset into the haystack.
    pub haystack_offset: usize,
    /// Depths (percent) of the planted needles, in planting order (NIAH only).
    pub depths: Vec<u32>,
    /// Tokens of the in-context example before the task (`vt` with
    /// [`TaskParams::vt_example`]; 0 otherwise).
    pub example_tokens: usize,
}

/// RULER's 40 evenly spaced needle depths, `round(linspace(0, 100, 40))`.
pub fn depths() -> Vec<u32> {
    (0..40)
        .map(|i| (i as f64 * 100.0 / 39.0).round() as u32)
        .collect()
}

const NIAH_TEMPLATE: &str = "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.\n{context}\nWhat are all the special magic numbers for {query} mentioned in the provided text?";
const NIAH_ANSWER: &str =
    " The special magic numbers for {query} mentioned in the provided text are";
/// [`PromptFormat::Chat`]'s answer prefix when one value is asked for.
const NIAH_ANSWER_ONE: &str =
    " The special magic number for {query} mentioned in the provided text is";
// The passkey test's own wording (its answer prefix must not repeat the instruction's first
// words: with "A pass key is hidden …" Gemma 3 continued the instruction instead).
const PASSKEY_TEMPLATE_ONE: &str = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information there.\n{context}\nWhat is the pass key for {query}?";
const PASSKEY_ANSWER_ONE: &str = " The pass key for {query} is";
const PASSKEY_TEMPLATE: &str = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information there.\n{context}\nWhat are all the pass keys for {query}?";
const PASSKEY_ANSWER: &str = " The pass keys for {query} are";

/// RULER's needle sentence.
pub fn needle(key: &str, value: &str) -> String {
    format!("One of the special magic numbers for {key} is: {value}.")
}

/// The seed of sample `index` of `task` under base seed `seed` (SplitMix64 of the three).
pub fn sample_seed(seed: u64, task: Task, index: usize) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(task.index() << 32)
        .wrapping_add(index as u64 + 1);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Whether a generation's text has ended its answer: the end-of-answer rule of `fathom ruler`
/// (a result records it as `stop: "answer"`), which saves generating RULER's full
/// `tokens_to_generate` after the answer. A newline after some alphanumeric output ends an
/// answer of one value (`":\n"` does not, so a reply that opens with a colon goes on); an
/// answer of several values (`several`: multivalue, multiquery, `vt`, `fwe`) is often a list,
/// one value per line, so only a blank line after alphanumeric output ends it. Score-wise the
/// rule can only lower a score against generating on (RULER's scoring counts gold strings
/// anywhere in the generation), never raise it.
pub fn answer_ended(text: &str, several: bool) -> bool {
    let end = if several { "\n\n" } else { "\n" };
    text.find(char::is_alphanumeric)
        .is_some_and(|i| text[i..].contains(end))
}

/// RULER's `string_match_all`: the fraction of `gold` found in `generation`, ignoring case.
pub fn score(generation: &str, gold: &[String]) -> f64 {
    if gold.is_empty() {
        return 0.0;
    }
    let g = generation.to_lowercase();
    gold.iter()
        .filter(|s| g.contains(&s.to_lowercase()))
        .count() as f64
        / gold.len() as f64
}

#[cfg(test)]
mod prose_tests {
    use super::*;

    #[test]
    fn prose_only_drops_markup_identifiers_and_numbers() {
        let text = "The login cookie isn't set, because :setting:`SESSION_COOKIE_DOMAIN` \
                    (for example) ``SESSION_COOKIE_DOMAIN = 'www.example.com'`` set to True. \
                    Note:: version 5.1 django.contrib.auth is_active ====== Why? ";
        let doc = text.repeat(200);
        let h = Haystack::new(std::iter::once(doc.as_str()), "test").unwrap();
        let p = h.prose_only().unwrap();
        let first: Vec<&str> = p.take(0, 14).collect();
        assert_eq!(
            first,
            [
                "The", "login", "cookie", "isn't", "set,", "because", "(for", "example)", "set",
                "to", "True.", "version", "Why?", "The"
            ]
        );
        assert!(p.source.ends_with("(prose words only)"));
        let tiny = Haystack::new(std::iter::once("x_1 ".repeat(2000).as_str()), "t").unwrap();
        assert!(tiny.prose_only().is_err(), "no prose word left is an error");
    }
}

#[cfg(test)]
mod needle_tests {
    use super::*;

    #[test]
    fn passkey_needles_parse_label_and_word_the_question() {
        let s = TaskShape::parse("small,needle=passkey,digits=5").unwrap();
        assert_eq!(s.needle, Needle::Passkey);
        assert_eq!((s.keys, s.digits), (2, 5));
        assert!(s.label().contains("passkey"), "{}", s.label());
        assert_eq!(
            TaskShape::parse("small,needle=magic").unwrap(),
            TaskShape::SMALL
        );
        let e = TaskShape::parse("small,needle=pin")
            .unwrap_err()
            .to_string();
        assert!(e.contains("needle=pin"), "{e}");
        assert_eq!(
            Needle::Passkey.sentence("calm-river", "12345"),
            "The pass key for calm-river is 12345. Remember it. 12345 is the pass key for calm-river."
        );
        assert_eq!(Needle::Magic.sentence("a-b", "7"), needle("a-b", "7"));
        // The answer prefix never repeats the instruction's opening words.
        for values in [1, 2] {
            let (t, a) = Needle::Passkey.template(&PromptFormat::Ruler, values);
            let opening: String = t.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
            assert!(!a.trim().starts_with(&opening), "{a:?} vs {opening:?}");
        }
    }
}

#[cfg(test)]
mod stop_tests {
    use super::*;

    #[test]
    fn one_value_ends_at_its_line_and_a_list_at_its_blank_line() {
        // One value: the line ends the answer, but a reply that opens with a colon goes on.
        assert!(!answer_ended(":\n\n", false));
        assert!(!answer_ended(" 6032278", false));
        assert!(answer_ended(":\n\n* 6032278\n", false));
        // Several: the list's lines do not end it (the old rule cut the list here, after
        // its first value), its blank line does.
        assert!(!answer_ended(":\n\n* 9326360\n", true));
        assert!(!answer_ended(":\n\n* 9326360\n* 4284637\n", true));
        assert!(answer_ended(":\n\n* 9326360\n* 4284637\n\nThese are", true));
        // What the list rule buys: the one-value rule would end this reply at its first
        // value, scoring 0.5 of a 1.0 answer.
        let g = [String::from("9326360"), String::from("4284637")];
        let first = ":\n\n* 9326360\n";
        assert!(answer_ended(first, false));
        assert_eq!(score(first, &g), 0.5);
        assert_eq!(score(":\n\n* 9326360\n* 4284637\n\n", &g), 1.0);
    }
}
