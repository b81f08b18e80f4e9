//! Choosing the drafter's mask token: an id whose embedding row the training never moves and
//! the data never trains, so that the masked block slots carry no meaning of their own.

use std::fmt;

/// What of a vocabulary the choice looks at.
#[derive(Debug, Clone, Default)]
pub(crate) struct Vocab {
    /// Rows of the target's embedding (`vocab_size`).
    pub model_rows: usize,
    /// Ids the tokenizer knows, added tokens included; rows past it are never produced by text.
    pub tokenizer_len: usize,
    /// The tokenizer's special added tokens: (id, text).
    pub specials: Vec<(u32, String)>,
}

impl Vocab {
    pub(crate) fn of(model_rows: usize, tokenizer: &tokenizers::Tokenizer) -> Self {
        let mut specials: Vec<(u32, String)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        specials.sort();
        Vocab {
            model_rows,
            tokenizer_len: tokenizer.get_vocab_size(true),
            specials,
        }
    }
}

/// A chosen mask token, with its text and why it was chosen.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MaskToken {
    pub id: u32,
    pub text: Option<String>,
    pub reason: String,
}

impl fmt::Display for MaskToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.text {
            Some(text) => write!(f, "{} ({text:?}): {}", self.id, self.reason),
            None => write!(f, "{}: {}", self.id, self.reason),
        }
    }
}

/// Words in a special token's name that mark it as never trained, in order of preference.
const UNTRAINED_HINTS: [&str; 5] = ["mask", "reserved", "unused", "empty", "pad"];

/// The mask token to suggest, or `None` where nothing is safe. `seen` holds the ids of the
/// training data (`None`: no data to check, so only ids no ordinary text produces are offered).
/// In order: the first embedding row past the tokenizer (no text encodes to it: Qwen3's
/// 151669; Qwen3.5 / 3.6's 248070, after the 26 added tokens from `<|endoftext|>` 248044 to
/// `</think>` 248069, which their published drafters use), a special token named like an untrained one ([`UNTRAINED_HINTS`]; SmolLM2's
/// `<empty_output>`, 16), and, with data, any special token, then the highest id it never holds.
pub(crate) fn suggest(vocab: &Vocab, seen: Option<&dyn Fn(u32) -> bool>) -> Option<MaskToken> {
    let unseen = |id: u32| (id as usize) < vocab.model_rows && !seen.is_some_and(|s| s(id));
    let checked = if seen.is_some() {
        "never occurs in the data"
    } else {
        "no data given to check it against"
    };
    let past = vocab.tokenizer_len as u32;
    if unseen(past) {
        return Some(MaskToken {
            id: past,
            text: None,
            reason: format!(
                "the first embedding row past the tokenizer's {past} tokens: no text encodes to it"
            ),
        });
    }
    let specials = || vocab.specials.iter().filter(|(id, _)| unseen(*id));
    for hint in UNTRAINED_HINTS {
        if let Some((id, text)) = specials().find(|(_, t)| t.to_lowercase().contains(hint)) {
            return Some(MaskToken {
                id: *id,
                text: Some(text.clone()),
                reason: format!("a special token named {hint:?}; {checked}"),
            });
        }
    }
    seen?;
    if let Some((id, text)) = specials().next() {
        return Some(MaskToken {
            id: *id,
            text: Some(text.clone()),
            reason: format!("a special token; {checked}"),
        });
    }
    let last = (0..vocab.model_rows as u32).rev().find(|&id| unseen(id))?;
    Some(MaskToken {
        id: last,
        text: None,
        reason: format!("the highest id that {checked}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials(names: &[(u32, &str)]) -> Vec<(u32, String)> {
        names.iter().map(|&(i, t)| (i, t.to_string())).collect()
    }

    #[test]
    fn qwen3_takes_the_first_row_past_the_tokenizer() {
        let vocab = Vocab {
            model_rows: 151_936,
            tokenizer_len: 151_669,
            specials: specials(&[(151_643, "<|endoftext|>"), (151_662, "<|fim_pad|>")]),
        };
        let got = suggest(&vocab, None).unwrap();
        assert_eq!((got.id, got.text.as_deref()), (151_669, None));
        assert!(
            got.reason.contains("past the tokenizer's 151669 tokens"),
            "{got}"
        );
        // ... unless the data holds it (then a named special token)
        let seen = |id: u32| id == 151_669;
        assert_eq!(suggest(&vocab, Some(&seen)).unwrap().id, 151_662);
    }

    /// A tokenizer.json with the added-token layout of Qwen3.5 / 3.6 (vocabulary 248320 rows):
    /// 248044 ordinary tokens (here made up, no merges), then 26 added tokens from
    /// `<|endoftext|>` at 248044 to `</think>` at 248069 (the tokenizers crate numbers added
    /// tokens after the model's vocabulary, as Qwen's files list them).
    fn qwen35_like_tokenizer() -> tokenizers::Tokenizer {
        let names = [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ];
        let added: Vec<serde_json::Value> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                serde_json::json!({"id": 248_044 + i, "content": n, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false,
                    "special": !n.starts_with("<tool") && !n.starts_with("</tool")
                        && !n.contains("think")})
            })
            .collect();
        let base: serde_json::Map<String, serde_json::Value> =
            (0..248_044).map(|i| (format!("t{i}"), i.into())).collect();
        let json = serde_json::json!({"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added, "normalizer": null, "pre_tokenizer": null,
            "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": base, "merges": []}});
        json.to_string().parse().unwrap()
    }

    #[test]
    fn qwen35_takes_the_row_after_its_added_tokens() {
        let tok = qwen35_like_tokenizer();
        let vocab = Vocab::of(248_320, &tok);
        assert_eq!(vocab.tokenizer_len, 248_070);
        let got = suggest(&vocab, None).unwrap();
        assert_eq!((got.id, got.text.as_deref()), (248_070, None));
        // the data holding it: a special token named like an untrained one
        let seen = |id: u32| id == 248_070;
        let got = suggest(&vocab, Some(&seen)).unwrap();
        assert_eq!(got.text.as_deref(), Some("<|vision_pad|>"));
    }

    #[test]
    fn smollm2_takes_empty_output() {
        let names = [
            (0, "<|endoftext|>"),
            (1, "<|im_start|>"),
            (2, "<|im_end|>"),
            (3, "<repo_name>"),
            (15, "<jupyter_script>"),
            (16, "<empty_output>"),
        ];
        let vocab = Vocab {
            model_rows: 49_152,
            tokenizer_len: 49_152,
            specials: specials(&names),
        };
        let seen = |id: u32| id <= 2 || id > 100;
        let got = suggest(&vocab, Some(&seen)).unwrap();
        assert_eq!(got.id, 16);
        assert_eq!(got.text.as_deref(), Some("<empty_output>"));
        assert_eq!(
            got.to_string(),
            "16 (\"<empty_output>\"): a special token named \"empty\"; never occurs in the data"
        );
        // without data, only a named token is offered
        assert_eq!(suggest(&vocab, None).unwrap().id, 16);
    }

    #[test]
    fn preference_and_fallbacks() {
        let vocab = Vocab {
            model_rows: 10,
            tokenizer_len: 10,
            specials: specials(&[
                (3, "<|pad|>"),
                (4, "<|reserved_special_token_0|>"),
                (5, "<s>"),
            ]),
        };
        // reserved before pad
        assert_eq!(suggest(&vocab, None).unwrap().id, 4);
        // seen tokens are skipped
        let seen = |id: u32| id == 4;
        assert_eq!(suggest(&vocab, Some(&seen)).unwrap().id, 3);
        // no named token left: any unseen special, then the highest unseen id
        let seen = |id: u32| id == 3 || id == 4;
        assert_eq!(suggest(&vocab, Some(&seen)).unwrap().id, 5);
        let seen = |id: u32| id != 7;
        let got = suggest(&vocab, Some(&seen)).unwrap();
        assert_eq!(got.id, 7);
        assert_eq!(got.reason, "the highest id that never occurs in the data");
        // no data and nothing named: nothing is safe to offer
        let plain = Vocab {
            specials: specials(&[(5, "<s>")]),
            ..vocab.clone()
        };
        assert_eq!(suggest(&plain, None), None);
        // every id seen
        assert_eq!(suggest(&vocab, Some(&|_| true)), None);
    }
}
