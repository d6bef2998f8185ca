//! edit_file's replacement planning: every old text must occur once in the original content
//! (whitespace and typography aside), edits may not overlap, and when an old text only matches
//! after normalisation the lines it does not touch are kept byte for byte.

pub struct Edit {
    pub old_text: Vec<u8>,
    pub new_text: Vec<u8>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum EditError {
    NotFound { index: usize },
    NotUnique { index: usize, count: usize },
    Overlap { first: usize, second: usize },
}

impl EditError {
    pub fn message(&self, path: &str) -> String {
        match self {
            Self::NotFound { index } => {
                format!("could not find edits[{index}].old_text in {path}, it must match the file's current content exactly")
            }
            Self::NotUnique { index, count } => {
                format!("found {count} occurrences of edits[{index}].old_text in {path}, it must be unique")
            }
            Self::Overlap { first, second } => {
                format!("edits[{first}] and edits[{second}] overlap in {path}; merge them into one edit or target disjoint regions")
            }
        }
    }
}

struct Matched<'a> {
    index: usize,
    at: usize,
    len: usize,
    new_text: &'a [u8],
}

/// The content after all edits, matched against `original` as a whole (not one after another).
pub fn apply(original: &[u8], edits: &[Edit]) -> Result<Vec<u8>, EditError> {
    let fuzzy_original = normalize(original);
    let mut any_fuzzy = false;
    for (index, e) in edits.iter().enumerate() {
        if find(original, &e.old_text, 0).is_some() {
            continue;
        }
        if find(&fuzzy_original, &normalize(&e.old_text), 0).is_none() {
            return Err(EditError::NotFound { index });
        }
        any_fuzzy = true;
    }
    let base: &[u8] = if any_fuzzy { &fuzzy_original } else { original };

    let mut matched = Vec::with_capacity(edits.len());
    for (index, e) in edits.iter().enumerate() {
        let fuzzy_old = normalize(&e.old_text);
        // Counted on normalised text, so a duplicate that differs only in whitespace still counts.
        let count = count_occurrences(&fuzzy_original, &fuzzy_old);
        if count > 1 {
            return Err(EditError::NotUnique { index, count });
        }
        let needle: &[u8] = if any_fuzzy { &fuzzy_old } else { &e.old_text };
        let at = find(base, needle, 0).ok_or(EditError::NotFound { index })?;
        matched.push(Matched { index, at, len: needle.len(), new_text: &e.new_text });
    }
    matched.sort_by_key(|m| m.at);
    for w in matched.windows(2) {
        if w[0].at + w[0].len > w[1].at {
            return Err(EditError::Overlap { first: w[0].index, second: w[1].index });
        }
    }
    Ok(if any_fuzzy { apply_keeping_untouched_lines(original, base, &matched) } else { replace(base, &matched, 0) })
}

/// `reps` ascending and disjoint, positions relative to `content` plus `offset`.
fn replace(content: &[u8], reps: &[Matched<'_>], offset: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(content.len());
    let mut pos = 0;
    for r in reps {
        let at = r.at - offset;
        out.extend_from_slice(&content[pos..at]);
        out.extend_from_slice(r.new_text);
        pos = at + r.len;
    }
    out.extend_from_slice(&content[pos..]);
    out
}

/// Normalisation keeps every line in place, so line `i` of `base` is line `i` of `original`:
/// the lines a replacement touches come from `base`, all others from `original`.
fn apply_keeping_untouched_lines(original: &[u8], base: &[u8], reps: &[Matched<'_>]) -> Vec<u8> {
    let original_lines = split_keep_newlines(original);
    let base_spans = line_spans(base);

    // (first line, end line, first replacement, end replacement); replacements are sorted, so a
    // group of replacements sharing lines is a contiguous run
    let mut groups: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (i, r) in reps.iter().enumerate() {
        let (start, end) = touched_lines(&base_spans, r.at, r.len);
        match groups.last_mut() {
            Some(g) if start < g.1 => {
                g.1 = g.1.max(end);
                g.3 = i + 1;
            }
            _ => groups.push((start, end, i, i + 1)),
        }
    }

    let mut out = Vec::with_capacity(original.len());
    let mut next_line = 0;
    for (start, end, first, last) in groups {
        for line in &original_lines[next_line.min(start)..start] {
            out.extend_from_slice(line);
        }
        let from = base_spans.get(start).map_or(base.len(), |s| s.0);
        let to = base_spans.get(end.wrapping_sub(1)).map_or(base.len(), |s| s.1);
        out.extend(replace(&base[from..to], &reps[first..last], from));
        next_line = end;
    }
    for line in original_lines.iter().skip(next_line) {
        out.extend_from_slice(line);
    }
    out
}

/// Lines `[start, end)` that bytes `at..at+len` of the content fall on.
fn touched_lines(spans: &[(usize, usize)], at: usize, len: usize) -> (usize, usize) {
    let start = spans.iter().position(|&(s, e)| at >= s && at < e).unwrap_or(spans.len());
    let mut end = start;
    while end < spans.len() && spans[end].1 < at + len {
        end += 1;
    }
    (start, (end + 1).min(spans.len()))
}

fn split_keep_newlines(content: &[u8]) -> Vec<&[u8]> {
    content.split_inclusive(|&b| b == b'\n').collect()
}

fn line_spans(content: &[u8]) -> Vec<(usize, usize)> {
    let mut pos = 0;
    split_keep_newlines(content)
        .into_iter()
        .map(|l| {
            let span = (pos, pos + l.len());
            pos += l.len();
            span
        })
        .collect()
}

/// Per line: trailing blanks dropped, typographic quotes, dashes and spaces made ASCII.
pub fn normalize(content: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(content.len());
    for (i, line) in content.split(|&b| b == b'\n').enumerate() {
        if i > 0 {
            out.push(b'\n');
        }
        let end = line.iter().rposition(|b| !matches!(b, b' ' | b'\t' | b'\r')).map_or(0, |p| p + 1);
        normalize_line(&line[..end], &mut out);
    }
    out
}

fn normalize_line(line: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while i < line.len() {
        let (ascii, width) = match &line[i..] {
            [0xE2, 0x80, 0x98..=0x9B, ..] => (b'\'', 3),
            [0xE2, 0x80, 0x9C..=0x9F, ..] => (b'"', 3),
            [0xE2, 0x80, 0x90..=0x95, ..] | [0xE2, 0x88, 0x92, ..] => (b'-', 3),
            [0xE2, 0x80, 0x82..=0x8A | 0xAF, ..] | [0xE2, 0x81, 0x9F, ..] | [0xE3, 0x80, 0x80, ..] => (b' ', 3),
            [0xC2, 0xA0, ..] => (b' ', 2),
            [b, ..] => (*b, 1),
            [] => unreachable!(),
        };
        out.push(ascii);
        i += width;
    }
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() {
        return Some(from.min(hay.len()));
    }
    hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

fn count_occurrences(hay: &[u8], needle: &[u8]) -> usize {
    if needle.is_empty() {
        return 0;
    }
    let (mut count, mut pos) = (0, 0);
    while let Some(at) = find(hay, needle, pos) {
        count += 1;
        pos = at + needle.len();
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edit(old: &str, new: &str) -> Edit {
        Edit { old_text: old.as_bytes().to_vec(), new_text: new.as_bytes().to_vec() }
    }

    fn run(original: &str, edits: &[Edit]) -> Result<String, EditError> {
        apply(original.as_bytes(), edits).map(|v| String::from_utf8(v).unwrap())
    }

    #[test]
    fn edits_match_the_original_not_each_other() {
        let out = run("line1\nline2\nline3\n", &[edit("line2", "line2-edited"), edit("line3\n", "line3\nline4\n")]);
        assert_eq!(out.unwrap(), "line1\nline2-edited\nline3\nline4\n");
        let swapped = run("a b", &[edit("a", "b"), edit("b", "a")]);
        assert_eq!(swapped.unwrap(), "b a");
    }

    #[test]
    fn duplicate_old_text_is_rejected() {
        assert_eq!(run("dup\ndup\n", &[edit("dup", "x")]), Err(EditError::NotUnique { index: 0, count: 2 }));
        // a copy that differs only in trailing whitespace is still a duplicate
        assert_eq!(run("x \nx\n", &[edit("x\n", "y\n")]), Err(EditError::NotUnique { index: 0, count: 2 }));
    }

    #[test]
    fn overlapping_edits_are_rejected_in_file_order() {
        let err = run("line1\nline2\n", &[edit("line2", "b"), edit("line1\nline2", "a")]);
        assert_eq!(err, Err(EditError::Overlap { first: 1, second: 0 }));
        assert!(EditError::Overlap { first: 1, second: 0 }.message("f").contains("overlap"));
    }

    #[test]
    fn missing_old_text_is_reported() {
        assert_eq!(run("abc", &[edit("abc", "x"), edit("zzz", "y")]), Err(EditError::NotFound { index: 1 }));
    }

    #[test]
    fn fuzzy_match_keeps_untouched_lines_verbatim() {
        let original = "keep \u{201c}this\u{201d}  \nfix \u{2018}me\u{2019}\nend\n";
        let out = run(original, &[edit("fix 'me'", "fixed")]).unwrap();
        assert_eq!(out, "keep \u{201c}this\u{201d}  \nfixed\nend\n");
    }

    #[test]
    fn normalize_maps_typography_per_line() {
        let n = normalize("a\u{00a0}b\u{2014}c \t\r\n\u{3000}x".as_bytes());
        assert_eq!(String::from_utf8(n).unwrap(), "a b-c\n x");
    }
}
