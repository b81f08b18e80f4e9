//! The first tokens of a text without tokenising all of it: tokenising an 8 MB record whole
//! took 1.98 GB (the tokenizer keeps a string, offsets and a word id per token) to keep 2,048
//! tokens of it.
//!
//! A tokenizer splits the text at its special tokens, then into pre-tokenizer chunks (words,
//! runs of spaces, ...), and makes tokens within each chunk. A chunk depends only on the text up
//! to just after it, so the chunks of a cut text that end well before the cut are those of the
//! whole text, and so are their tokens. [`TextTokenizer::encode_prefix`] tokenises a cut of
//! the text, keeps it when a whole chunk lies between the tokens it needs and the unsettled end
//! of the cut, and else doubles the cut (up to the whole text).

use anyhow::{anyhow, Result};
use tokenizers::Encoding;

use crate::text::TextTokenizer;

/// Byte offsets `(start, end)` of a token in the text.
pub(crate) type ByteSpan = (usize, usize);

/// The first tokens of a text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenPrefix {
    pub ids: Vec<u32>,
    pub offsets: Vec<ByteSpan>,
    /// The text has more tokens than were kept.
    pub more: bool,
}

/// Bytes per token of the first cut (English text averages about 4): a cut too short is
/// doubled, so this only sets how often.
const FIRST_CUT_BYTES_PER_TOKEN: usize = 8;

/// Bytes at the end of a cut whose chunks may differ from the whole text's: a special token cut
/// in two (the longest of Qwen3, Llama 3 and Gemma 3 have under 30 bytes), a pre-tokenizer rule
/// that looks one character ahead.
const UNSETTLED_BYTES: usize = 1024;

impl TextTokenizer {
    /// The first `n` tokens of `text`, the same ids and offsets as tokenising all of it gives,
    /// from a cut of it about as long as those tokens need.
    pub(crate) fn encode_prefix(&self, text: &str, n: usize) -> Result<TokenPrefix> {
        let mut cut = n
            .saturating_add(1)
            .saturating_mul(FIRST_CUT_BYTES_PER_TOKEN)
            .saturating_add(2 * UNSETTLED_BYTES);
        while cut < text.len() {
            let end = floor_char_boundary(text, cut);
            let enc = self.encode_raw(&text[..end])?;
            if settled(&enc, n, end) {
                return Ok(first_tokens(&enc, n));
            }
            cut = cut.saturating_mul(2);
        }
        Ok(first_tokens(&self.encode_raw(text)?, n))
    }

    fn encode_raw(&self, text: &str) -> Result<Encoding> {
        self.inner()
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenise: {e}"))
    }
}

/// The first `n` tokens of an encoding, and whether it has more.
fn first_tokens(enc: &Encoding, n: usize) -> TokenPrefix {
    let kept = n.min(enc.len());
    TokenPrefix {
        ids: enc.get_ids()[..kept].to_vec(),
        offsets: enc.get_offsets()[..kept].to_vec(),
        more: enc.len() > n,
    }
}

/// Whether the first `n + 1` tokens of `enc`, the encoding of a text cut at byte `end`, are
/// those of the whole text (the one after the `n` kept tells that there are more): a token of
/// a chunk two or more after theirs ends before the unsettled end of the cut, so the chunk
/// between lies whole before it.
fn settled(enc: &Encoding, n: usize, end: usize) -> bool {
    let words = enc.get_word_ids();
    let Some(Some(word)) = words.get(n) else {
        return false;
    };
    let settled_end = end.saturating_sub(UNSETTLED_BYTES);
    // Offsets may be trimmed of spaces, but a token's trimmed end is never before its start.
    words
        .iter()
        .zip(enc.get_offsets())
        .skip(n + 1)
        .take_while(|(_, o)| o.1 <= settled_end)
        .any(|(w, _)| w.is_some_and(|w| w >= word + 2))
}

/// The largest char boundary of `text` at or before `at`.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}
