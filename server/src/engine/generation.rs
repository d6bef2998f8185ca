//! Text accounting for one generation: which bytes may be sent now, stop strings, and why it
//! stopped. Follows llama-server's process_token: text that may still become a stop string, or
//! ends in an incomplete UTF-8 sequence, is held back until it is settled.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopType {
    None,
    Eos,
    Word,
    Limit,
}

impl StopType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Eos => "eos",
            Self::Word => "word",
            Self::Limit => "limit",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Generation {
    stops: Vec<String>,
    text: Vec<u8>,
    n_sent: usize,
    pub stop: StopType,
    pub stopping_word: String,
    pub has_new_line: bool,
}

/// Length of `text` without a trailing, incomplete multi-byte UTF-8 sequence.
pub fn complete_utf8_len(text: &[u8]) -> usize {
    let len = text.len();
    for i in 1..=len.min(4) {
        let c = text[len - i];
        let needed = if c & 0xE0 == 0xC0 {
            2
        } else if c & 0xF0 == 0xE0 {
            3
        } else if c & 0xF8 == 0xF0 {
            4
        } else {
            continue;
        };
        if i < needed {
            return len - i;
        }
    }
    len
}

/// Where a suffix of `text` starts that is a proper beginning of `stop`, if any.
fn find_partial_stop(text: &[u8], stop: &[u8]) -> Option<usize> {
    let last = *text.last()?;
    (1..=text.len().min(stop.len())).rev().find(|&len| stop[len - 1] == last && text.ends_with(&stop[..len])).map(|len| text.len() - len)
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || from > hay.len() {
        return None;
    }
    hay[from..].windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

impl Generation {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, text: Vec::new(), n_sent: 0, stop: StopType::None, stopping_word: String::new(), has_new_line: false }
    }

    /// The earliest stop-string position in `unsent` (full match near its end, or a partial one
    /// at its end); a full match also records the stop.
    fn find_stop(&mut self, unsent: &[u8], last_piece_len: usize, full: bool) -> Option<usize> {
        let mut best: Option<usize> = None;
        for word in &self.stops {
            let w = word.as_bytes();
            let pos = if full { find(unsent, w, unsent.len().saturating_sub(w.len() + last_piece_len)) } else { find_partial_stop(unsent, w) };
            if let Some(p) = pos {
                if best.is_none_or(|b| p < b) {
                    if full {
                        self.stop = StopType::Word;
                        self.stopping_word = word.clone();
                    }
                    best = Some(p);
                }
            }
        }
        best
    }

    /// Adds one sampled token's text; returns the bytes that may be sent to the client now, or
    /// None while the text ends inside a UTF-8 character (llama-server then reports nothing for
    /// the token: no stream chunk, no probabilities; the next token carries its bytes).
    pub fn push(&mut self, piece: &[u8], is_eog: bool) -> Option<Vec<u8>> {
        self.text.extend_from_slice(piece);
        if complete_utf8_len(&self.text) < self.text.len() {
            return None;
        }
        let pos = self.n_sent.min(self.text.len());
        let unsent = self.text[pos..].to_vec();
        let mut send = true;
        if let Some(stop_pos) = self.find_stop(&unsent, piece.len(), true) {
            self.text.truncate(pos + stop_pos);
        } else if !is_eog && self.find_stop(&unsent, piece.len(), false).is_some() {
            send = false;
        }
        if !send {
            return Some(Vec::new());
        }
        let pos = self.n_sent.min(self.text.len());
        let out = self.text[pos..].to_vec();
        self.n_sent += out.len();
        if out.contains(&b'\n') {
            self.has_new_line = true;
        }
        Some(out)
    }

    pub fn finished(&self) -> bool {
        self.stop != StopType::None
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.text).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, Generation) {
        let mut g = Generation::new(stops.iter().map(|s| s.to_string()).collect());
        let sent = pieces.iter().map(|p| String::from_utf8(g.push(p.as_bytes(), false).unwrap()).unwrap()).collect();
        (sent, g)
    }

    #[test]
    fn plain_text_is_sent_as_it_comes() {
        let (sent, g) = run(&[], &["Hel", "lo", " world"]);
        assert_eq!(sent, ["Hel", "lo", " world"]);
        assert_eq!(g.text(), "Hello world");
        assert!(!g.finished());
    }

    #[test]
    fn a_stop_string_is_cut_and_never_sent() {
        let (sent, g) = run(&["END"], &["one ", "E", "N", "D tail"]);
        assert_eq!(sent, ["one ", "", "", ""]);
        assert_eq!(g.text(), "one ");
        assert_eq!(g.stop, StopType::Word);
        assert_eq!(g.stopping_word, "END");
    }

    #[test]
    fn a_held_back_prefix_is_released_when_it_stops_matching() {
        let (sent, g) = run(&["END"], &["a", "E", "x"]);
        assert_eq!(sent, ["a", "", "Ex"]);
        assert!(!g.finished());
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        let (_, g) = run(&["world", "lo w"], &["hello world"]);
        assert_eq!(g.text(), "hel");
        assert_eq!(g.stopping_word, "lo w");
    }

    #[test]
    fn incomplete_utf8_is_held_back() {
        let mut g = Generation::new(vec![]);
        let e = "é".as_bytes();
        assert_eq!(g.push(&e[..1], false), None);
        assert_eq!(g.push(&e[1..], false).as_deref(), Some(e));
        assert_eq!(complete_utf8_len(&[b'a', 0xF0, 0x9F]), 1);
        assert_eq!(complete_utf8_len("ab€".as_bytes()), 5);
    }
}
