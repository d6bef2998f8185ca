//! llama.cpp's path globs (`common/common.cpp` glob_match): `*` and `?` stop at `/`, `**` crosses
//! it, `[...]` is a byte class with `!` negation and ranges.

/// Directories a listing reports but never descends into: they can be enormous.
pub const JUNK_DIRS: &[&str] =
    &[".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist", "build", "target", ".cache", ".idea", ".vscode"];

pub fn is_junk_dir(name: &str) -> bool {
    JUNK_DIRS.contains(&name)
}

/// Depth of a `/`-separated relative path: `a/b/c` is 3.
pub fn entry_depth(rel: &str) -> usize {
    1 + rel.bytes().filter(|&b| b == b'/').count()
}

/// A pattern without `/` matches the basename at any depth; one with `/` matches the whole
/// relative path, anchored with `**/` unless it already starts with `**/` or `/`.
pub fn path_glob_match(pattern: &str, rel: &str) -> bool {
    if !pattern.contains('/') {
        let base = rel.rsplit('/').next().unwrap_or(rel);
        return glob_match(pattern, base);
    }
    if pattern == "**" || pattern.starts_with("**/") || pattern.starts_with('/') {
        return glob_match(pattern, rel);
    }
    glob_match(&format!("**/{pattern}"), rel)
}

pub fn glob_match(pattern: &str, s: &str) -> bool {
    matches(pattern.as_bytes(), s.as_bytes())
}

fn matches(p: &[u8], s: &[u8]) -> bool {
    match p {
        [] => s.is_empty(),
        [b'*', b'*', rest @ ..] => (0..=s.len()).any(|i| matches(rest, &s[i..])),
        [b'*', rest @ ..] => {
            let run = s.iter().position(|&c| c == b'/').unwrap_or(s.len());
            (0..=run).any(|i| matches(rest, &s[i..]))
        }
        [b'?', rest @ ..] if !s.is_empty() && s[0] != b'/' => matches(rest, &s[1..]),
        [b'[', ..] => {
            let mut end = 1;
            if matches!(p.get(1), Some(b']' | b'-')) {
                end += 1;
            }
            while end < p.len() && p[end] != b']' {
                end += 1;
            }
            if end < p.len() {
                !s.is_empty() && class_matches(s[0], &p[1..end]) && matches(&p[end + 1..], &s[1..])
            } else {
                s.first() == Some(&b'[') && matches(&p[1..], &s[1..])
            }
        }
        [c, rest @ ..] => s.first() == Some(c) && matches(rest, &s[1..]),
    }
}

/// `class` is the text between `[` and its closing `]`.
fn class_matches(c: u8, class: &[u8]) -> bool {
    let (negated, mut class) = match class {
        [b'!', rest @ ..] => (true, rest),
        _ => (false, class),
    };
    if let [first @ (b']' | b'-'), rest @ ..] = class {
        if *first == c {
            return !negated;
        }
        class = rest;
    }
    let mut matched = false;
    let mut i = 0;
    while i < class.len() {
        if i + 2 < class.len() && class[i + 1] == b'-' && class[i + 2] != b']' {
            if (class[i]..=class[i + 2]).contains(&c) {
                matched = true;
                break;
            }
            i += 3;
        } else {
            if class[i] == c {
                matched = true;
                break;
            }
            i += 1;
        }
    }
    matched != negated
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn star_stops_at_slash_and_double_star_crosses_it() {
        assert!(glob_match("*.cpp", "main.cpp"));
        assert!(!glob_match("*.cpp", "src/main.cpp"));
        assert!(glob_match("**/*.cpp", "src/a/main.cpp"));
        assert!(glob_match("**", "a/b/c"));
        assert!(glob_match("src/**", "src/a/b"));
        assert!(!glob_match("?", "/"));
        assert!(glob_match("a?c", "abc"));
    }

    #[test]
    fn classes_ranges_and_negation() {
        assert!(glob_match("file[0-9].txt", "file7.txt"));
        assert!(!glob_match("file[0-9].txt", "filex.txt"));
        assert!(glob_match("file[!0-9].txt", "filex.txt"));
        assert!(!glob_match("file[!0-9].txt", "file1.txt"));
        assert!(glob_match("[]]", "]"));
        assert!(glob_match("[-a]", "-"));
        assert!(glob_match("a[b", "a[b"));
        assert!(!glob_match("a[b", "ab"));
    }

    #[test]
    fn path_patterns_anchor_as_documented() {
        assert!(path_glob_match("*.txt", "a/b/notes.txt"));
        assert!(path_glob_match("*proj*", "project-alpha"));
        assert!(path_glob_match("src/*.cpp", "lib/src/main.cpp"));
        assert!(!path_glob_match("/src/*.cpp", "lib/src/main.cpp"));
        assert!(path_glob_match("**", "x/y"));
        assert!(!path_glob_match("src/*.cpp", "src/a/main.cpp"));
    }

    #[test]
    fn depth_and_junk_dirs() {
        assert_eq!(entry_depth("a"), 1);
        assert_eq!(entry_depth("a/b/c"), 3);
        assert!(is_junk_dir("node_modules"));
        assert!(is_junk_dir("build"));
        assert!(!is_junk_dir("src"));
        assert!(!is_junk_dir("Build"));
    }
}
