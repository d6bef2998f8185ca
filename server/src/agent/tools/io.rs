//! Where a tool's file and process operations happen: on the host, or inside an isolate (a
//! container reached with `<engine> exec`, or a host reached over ssh) chosen per call.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::glob::{entry_depth, is_junk_dir, JUNK_DIRS};
use super::process::{self, ExecResult, OnChunk, Spawn};
use super::ToolError;

/// Budget for one listing, shared by `git ls-files` and the directory walk.
const LIST_TIMEOUT: Duration = Duration::from_secs(15);
const GIT_LS_FILES_MAX_OUTPUT: usize = 8 * 1024 * 1024;
/// Limit for the helper commands an isolate runs (stat, cat, find); shell commands set their own.
const ISOLATE_HELPER_TIMEOUT: Duration = Duration::from_secs(15);
const ISOLATE_READ_MAX: usize = 64 * 1024 * 1024;
/// Extra time the host gives an isolate's own `timeout` to end the command cleanly.
const ISOLATE_TIMEOUT_GRACE: Duration = Duration::from_secs(5);
const SMALL_OUTPUT: usize = 4096;
pub const NOT_A_DIRECTORY: &str = "path does not exist or is not a directory";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ListKind {
    Files,
    Dirs,
    All,
}

impl ListKind {
    fn dirs(self) -> bool {
        matches!(self, Self::Dirs | Self::All)
    }

    fn files(self) -> bool {
        matches!(self, Self::Files | Self::All)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    /// `/`-separated, relative to the listed base.
    pub rel: String,
    pub is_dir: bool,
}

#[derive(Debug, Default)]
pub struct Listing {
    pub entries: Vec<ListEntry>,
    /// The walk ran out of time or met a directory it could not read.
    pub truncated: bool,
}

pub trait ToolIo {
    /// `path` made absolute against the call's working directory.
    fn resolve(&self, path: &str) -> String;
    fn is_dir(&self, path: &str) -> bool;
    fn is_file(&self, path: &str) -> bool;
    fn file_size(&self, path: &str) -> Option<u64>;
    fn read(&self, path: &str) -> Option<Vec<u8>>;
    fn write(&self, path: &str, content: &[u8]) -> bool;
    /// Entries under `base` (already resolved); `max_depth` 0 is unlimited, 1 direct children only.
    fn list(&self, base: &str, max_depth: usize, kind: ListKind) -> Option<Listing>;
    fn run(&self, argv: &[String], max_output: usize, timeout: Duration, on_chunk: OnChunk<'_>) -> ExecResult;
    /// Whether commands run in a POSIX isolate rather than on this host.
    fn is_isolated(&self) -> bool;
}

/// The I/O for one call: `runtime` empty runs on the host, else it names an isolate.
pub fn for_call(cwd: &str, runtime: &str) -> Result<Box<dyn ToolIo>, ToolError> {
    if runtime.is_empty() {
        return Ok(Box::new(HostIo { cwd: cwd.to_string() }));
    }
    let transport = match RuntimeSpec::parse(runtime)? {
        RuntimeSpec::Spawn { .. } => {
            // spawning belongs to --tools-runtime, which owns the container; a call only attaches
            return Err(ToolError::Failed(format!("tool runtime must name a running container: {runtime}")));
        }
        RuntimeSpec::Attach { engine, id } => Transport::Container { engine, id },
        RuntimeSpec::Ssh { target } => Transport::Ssh { target },
    };
    Ok(Box::new(IsolateIo { cwd: cwd.to_string(), transport }))
}

/// A `--tools-runtime` / `x-tool-runtime` value.
#[derive(Debug, PartialEq, Eq)]
pub enum RuntimeSpec {
    /// `docker:<image>`: a container this server starts and owns.
    Spawn { engine: &'static str, image: String },
    /// `docker-container:<id>`: a running container.
    Attach { engine: &'static str, id: String },
    /// `ssh:<target>`: remoting, not isolation; the tools can do anything the account can.
    Ssh { target: String },
}

const CONTAINER_ENGINES: [&str; 2] = ["docker", "podman"];

impl RuntimeSpec {
    pub fn parse(spec: &str) -> Result<Self, ToolError> {
        for engine in CONTAINER_ENGINES {
            if let Some(id) = spec.strip_prefix(engine).and_then(|r| r.strip_prefix("-container:")) {
                if !is_valid_container_id(id) {
                    return Err(ToolError::Failed(format!("invalid container id: {id}")));
                }
                return Ok(Self::Attach { engine, id: id.to_string() });
            }
            if let Some(image) = spec.strip_prefix(engine).and_then(|r| r.strip_prefix(':')) {
                return Ok(Self::Spawn { engine, image: image.to_string() });
            }
        }
        if let Some(target) = spec.strip_prefix("ssh:") {
            if !is_valid_ssh_target(target) {
                return Err(ToolError::Failed(format!("invalid ssh target: {target}")));
            }
            return Ok(Self::Ssh { target: target.to_string() });
        }
        // never fall back to the host: the caller asked for an isolate
        Err(ToolError::Failed(format!("unknown tool runtime: {spec}")))
    }
}

/// The id lands on the `<engine> exec` command line, so one that reads as an option
/// (`--privileged`) must not get through.
pub fn is_valid_container_id(id: &str) -> bool {
    id.starts_with(|c: char| c.is_ascii_alphanumeric()) && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

/// ssh reads options from its argv: a target like `-oProxyCommand=...` would run on this host.
pub fn is_valid_ssh_target(target: &str) -> bool {
    !target.is_empty() && !target.starts_with('-') && target.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '@'))
}

fn home_dir() -> Option<String> {
    crate::cli::env::upstream(crate::cli::env::Upstream::Home).filter(|h| !h.is_empty())
}

fn expand_home(path: &str) -> String {
    match (path.strip_prefix('~'), home_dir()) {
        (Some(rest), Some(home)) if rest.is_empty() || rest.starts_with('/') => format!("{home}{rest}"),
        _ => path.to_string(),
    }
}

/// Joins a relative `path` onto `cwd` and drops `.` and `..` without touching the file system.
pub fn resolve_host(path: &str, cwd: &str, process_cwd: impl FnOnce() -> Option<String>) -> String {
    let path = expand_home(path);
    let full = if path.starts_with('/') {
        path
    } else {
        let base = if cwd.is_empty() {
            match process_cwd() {
                Some(c) => c,
                None => return path,
            }
        } else {
            cwd.to_string()
        };
        format!("{base}/{path}")
    };
    normalize_lexically(&full)
}

fn normalize_lexically(path: &str) -> String {
    let absolute = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => match parts.last() {
                Some(&last) if last != ".." => {
                    parts.pop();
                }
                _ if absolute => {}
                _ => parts.push(".."),
            },
            p => parts.push(p),
        }
    }
    let joined = parts.join("/");
    match (absolute, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".to_string(),
        (false, false) => joined,
    }
}

struct HostIo {
    cwd: String,
}

impl HostIo {
    fn path(&self, p: &str) -> PathBuf {
        PathBuf::from(self.resolve(p))
    }

    fn git_ls_files(&self, base: &str, max_depth: usize) -> Option<Vec<ListEntry>> {
        let argv: Vec<String> = ["git", "-C", base, "ls-files", "-z", "--cached", "--others", "--exclude-standard"].map(String::from).into();
        let res = self.run(&argv, GIT_LS_FILES_MAX_OUTPUT, LIST_TIMEOUT, None);
        if !res.ok() {
            return None;
        }
        let text = res.text();
        let base = Path::new(base);
        Some(
            text.split('\0')
                .filter(|rel| !rel.is_empty() && (max_depth == 0 || entry_depth(rel) <= max_depth))
                .filter(|rel| base.join(rel).is_file())
                .map(|rel| ListEntry { rel: rel.to_string(), is_dir: false })
                .collect(),
        )
    }
}

impl ToolIo for HostIo {
    fn resolve(&self, path: &str) -> String {
        resolve_host(path, &self.cwd, || std::env::current_dir().ok().map(|p| p.to_string_lossy().into_owned()))
    }

    fn is_dir(&self, path: &str) -> bool {
        self.path(path).is_dir()
    }

    fn is_file(&self, path: &str) -> bool {
        self.path(path).is_file()
    }

    fn file_size(&self, path: &str) -> Option<u64> {
        fs::metadata(self.path(path)).ok().filter(fs::Metadata::is_file).map(|m| m.len())
    }

    fn read(&self, path: &str) -> Option<Vec<u8>> {
        fs::read(self.path(path)).ok()
    }

    fn write(&self, path: &str, content: &[u8]) -> bool {
        let path = self.path(path);
        if let Some(parent) = path.parent() {
            if fs::create_dir_all(parent).is_err() {
                return false;
            }
        }
        fs::write(path, content).is_ok()
    }

    fn list(&self, base: &str, max_depth: usize, kind: ListKind) -> Option<Listing> {
        if !Path::new(base).is_dir() {
            return None;
        }
        // git ls-files honours .gitignore but cannot list directories
        if kind == ListKind::Files {
            if let Some(entries) = self.git_ls_files(base, max_depth) {
                return Some(Listing { entries, truncated: false });
            }
        }
        Some(walk(Path::new(base), max_depth, kind, Instant::now() + LIST_TIMEOUT))
    }

    fn run(&self, argv: &[String], max_output: usize, timeout: Duration, on_chunk: OnChunk<'_>) -> ExecResult {
        let spawn = Spawn { argv, cwd: Some(&self.cwd), stdin: None, combine_stderr: true, max_output, timeout };
        process::run(&spawn, on_chunk)
    }

    fn is_isolated(&self) -> bool {
        false
    }
}

/// Depth-first walk that reports junk directories without entering them and never follows a
/// link into a directory, since a link can point back at an ancestor.
pub fn walk(base: &Path, max_depth: usize, kind: ListKind, deadline: Instant) -> Listing {
    let mut out = Listing::default();
    let mut stack = vec![(base.to_path_buf(), String::new(), 0usize)];
    while let Some((dir, rel_dir, depth)) = stack.pop() {
        if Instant::now() >= deadline {
            out.truncated = true;
            return out;
        }
        let read = match fs::read_dir(&dir) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => continue,
            Err(_) => {
                out.truncated = true;
                continue;
            }
        };
        let mut names: Vec<(String, PathBuf, fs::FileType)> = Vec::new();
        for entry in read {
            let Ok(entry) = entry else {
                out.truncated = true;
                break;
            };
            let Ok(ft) = entry.file_type() else { continue };
            names.push((entry.file_name().to_string_lossy().into_owned(), entry.path(), ft));
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        let mut subdirs = Vec::new();
        for (name, path, ft) in names {
            let rel = if rel_dir.is_empty() { name.clone() } else { format!("{rel_dir}/{name}") };
            // a link counts as what it points at, but is never walked
            let is_dir = if ft.is_symlink() { path.is_dir() } else { ft.is_dir() };
            if is_dir {
                if kind.dirs() {
                    out.entries.push(ListEntry { rel: rel.clone(), is_dir: true });
                }
                if !is_junk_dir(&name) && !ft.is_symlink() && (max_depth == 0 || depth + 1 < max_depth) {
                    subdirs.push((path, rel, depth + 1));
                }
            } else if kind.files() && (ft.is_file() || (ft.is_symlink() && path.is_file())) {
                out.entries.push(ListEntry { rel, is_dir: false });
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
    out
}

enum Transport {
    Container { engine: &'static str, id: String },
    Ssh { target: String },
}

impl Transport {
    /// The host argv that runs `inner` (a complete POSIX argv) in the isolate.
    fn argv(&self, inner: &[String], needs_stdin: bool) -> Vec<String> {
        match self {
            Self::Container { engine, id } => {
                let mut argv = vec![engine.to_string(), "exec".into()];
                if needs_stdin {
                    argv.push("-i".into());
                }
                argv.push(id.clone());
                argv.extend(inner.iter().cloned());
                argv
            }
            Self::Ssh { target } => {
                // there is no console to answer a prompt, and the host key must already be trusted
                let mut argv: Vec<String> = [
                    "ssh",
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "PasswordAuthentication=no",
                    "-o",
                    "KbdInteractiveAuthentication=no",
                    "-o",
                    "StrictHostKeyChecking=yes",
                ]
                .map(String::from)
                .into();
                if !needs_stdin {
                    argv.push("-n".into());
                }
                argv.push(target.clone());
                // the remote shell re-parses its command line, so the argv travels as one quoted word
                argv.push(shell_quote_join(inner));
                argv
            }
        }
    }
}

/// One string a POSIX shell splits back into exactly `argv`.
pub fn shell_quote_join(argv: &[String]) -> String {
    argv.iter().map(|a| format!("'{}'", a.replace('\'', r"'\''"))).collect::<Vec<_>>().join(" ")
}

/// Every operation is a command in the isolate, which must offer sh, cat, wc, mkdir, dirname,
/// find and timeout; paths there are always POSIX.
struct IsolateIo {
    cwd: String,
    transport: Transport,
}

fn strings(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

impl IsolateIo {
    fn exec(&self, inner: &[String], max_output: usize, combine_stderr: bool, stdin: Option<&[u8]>) -> ExecResult {
        let argv = self.transport.argv(inner, stdin.is_some());
        let spawn = Spawn { argv: &argv, cwd: None, stdin, combine_stderr, max_output, timeout: ISOLATE_HELPER_TIMEOUT };
        process::run(&spawn, None)
    }

    fn test(&self, flag: &str, path: &str) -> bool {
        self.exec(&strings(&["sh", "-c", &format!("[ {flag} \"$1\" ]"), "_", &self.resolve(path)]), SMALL_OUTPUT, true, None).ok()
    }

    /// One `find` pass; `-prune` keeps junk directories listed but unvisited, and only
    /// -mindepth/-maxdepth are used so a busybox image works as well as a GNU one.
    fn find(&self, base: &str, max_depth: usize, dirs: bool, truncated: &mut bool) -> Vec<String> {
        let prune = JUNK_DIRS.iter().map(|n| format!("-name {n}")).collect::<Vec<_>>().join(" -o ");
        let mut cmd = String::from("cd \"$1\" && find . -mindepth 1");
        if max_depth > 0 {
            cmd += &format!(" -maxdepth {max_depth}");
        }
        cmd += &format!(" \\( {prune} \\) -prune");
        cmd += if dirs { " -print -o -type d -print" } else { " -o -type f -print" };
        let res = self.exec(&strings(&["sh", "-c", &cmd, "_", base]), GIT_LS_FILES_MAX_OUTPUT, true, None);
        *truncated |= res.timed_out;
        split_lines(&res.text()).map(|l| l.strip_prefix("./").unwrap_or(l).to_string()).collect()
    }
}

fn split_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|l| !l.is_empty())
}

impl ToolIo for IsolateIo {
    fn resolve(&self, path: &str) -> String {
        if self.cwd.is_empty() || path.starts_with('/') {
            path.to_string()
        } else {
            format!("{}/{path}", self.cwd)
        }
    }

    fn is_dir(&self, path: &str) -> bool {
        self.test("-d", path)
    }

    fn is_file(&self, path: &str) -> bool {
        self.test("-f", path)
    }

    fn file_size(&self, path: &str) -> Option<u64> {
        let res = self.exec(&strings(&["sh", "-c", "wc -c < \"$1\"", "_", &self.resolve(path)]), 64, true, None);
        if !res.ok() {
            return None;
        }
        res.text().trim().parse().ok()
    }

    fn read(&self, path: &str) -> Option<Vec<u8>> {
        let res = self.exec(&strings(&["cat", "--", &self.resolve(path)]), ISOLATE_READ_MAX, false, None);
        res.ok().then_some(res.output)
    }

    fn write(&self, path: &str, content: &[u8]) -> bool {
        // the content travels on stdin: nothing for the far side to re-parse, no temp file here
        let inner = strings(&["sh", "-c", "mkdir -p \"$(dirname \"$1\")\" && cat > \"$1\"", "_", &self.resolve(path)]);
        self.exec(&inner, SMALL_OUTPUT, true, Some(content)).ok()
    }

    fn list(&self, base: &str, max_depth: usize, kind: ListKind) -> Option<Listing> {
        let base = self.resolve(base);
        if !self.is_dir(&base) {
            return None;
        }
        if kind == ListKind::Files {
            let inner = strings(&["sh", "-c", "cd \"$1\" && git ls-files --cached --others --exclude-standard", "_", &base]);
            let res = self.exec(&inner, GIT_LS_FILES_MAX_OUTPUT, true, None);
            if res.ok() {
                let entries = split_lines(&res.text())
                    .filter(|rel| max_depth == 0 || entry_depth(rel) <= max_depth)
                    .map(|rel| ListEntry { rel: rel.to_string(), is_dir: false })
                    .collect();
                return Some(Listing { entries, truncated: false });
            }
        }
        let mut out = Listing::default();
        if kind.dirs() {
            let found = self.find(&base, max_depth, true, &mut out.truncated);
            out.entries.extend(found.into_iter().map(|rel| ListEntry { rel, is_dir: true }));
        }
        if kind.files() {
            let found = self.find(&base, max_depth, false, &mut out.truncated);
            out.entries.extend(found.into_iter().map(|rel| ListEntry { rel, is_dir: false }));
        }
        Some(out)
    }

    /// The isolate's own `timeout` wraps the command: killing the local client would leave the
    /// process tree inside the isolate running.
    fn run(&self, argv: &[String], max_output: usize, timeout: Duration, on_chunk: OnChunk<'_>) -> ExecResult {
        let mut inner = vec!["timeout".to_string(), format!("{}s", timeout.as_secs())];
        inner.extend(argv.iter().cloned());
        if !self.cwd.is_empty() {
            // no transport has a portable working-directory option; 127 is a shell's "could not run"
            let mut wrapped = strings(&["sh", "-c", "cd \"$1\" || exit 127; shift; exec \"$@\"", "_", &self.cwd]);
            wrapped.extend(inner);
            inner = wrapped;
        }
        let host_argv = self.transport.argv(&inner, true);
        let spawn = Spawn { argv: &host_argv, cwd: None, stdin: Some(b""), combine_stderr: true, max_output, timeout: timeout + ISOLATE_TIMEOUT_GRACE };
        process::run(&spawn, on_chunk)
    }

    fn is_isolated(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed_cwd() -> Option<String> {
        Some("/srv/app".into())
    }

    #[test]
    fn resolves_against_the_call_cwd_then_the_process_cwd() {
        assert_eq!(resolve_host("rel.txt", "/work/dir", fixed_cwd), "/work/dir/rel.txt");
        assert_eq!(resolve_host("rel.txt", "", fixed_cwd), "/srv/app/rel.txt");
        assert_eq!(resolve_host("/abs/x.txt", "/work/dir", fixed_cwd), "/abs/x.txt");
        assert_eq!(resolve_host("./a/../b/./c/", "/w", fixed_cwd), "/w/b/c");
        assert_eq!(resolve_host("../../../..", "/w/x", fixed_cwd), "/");
        assert_eq!(resolve_host(".", "/w/x/", fixed_cwd), "/w/x");
        assert_eq!(resolve_host("sub//out.txt", "/w", fixed_cwd), "/w/sub/out.txt");
    }

    #[test]
    fn expands_a_leading_tilde_only() {
        let Some(home) = home_dir() else { return };
        assert_eq!(resolve_host("~/x", "/w", fixed_cwd), normalize_lexically(&format!("{home}/x")));
        assert_eq!(resolve_host("~user/x", "/w", fixed_cwd), "/w/~user/x");
        assert_eq!(resolve_host("a/~/x", "/w", fixed_cwd), "/w/a/~/x");
    }

    #[test]
    fn runtime_specs_reject_option_injection_and_unknown_schemes() {
        let msg = |s: &str| RuntimeSpec::parse(s).unwrap_err().to_string();
        assert_eq!(msg("docker-container:--privileged"), "invalid container id: --privileged");
        assert_eq!(msg("podman-container:-v/:/host"), "invalid container id: -v/:/host");
        assert_eq!(msg("docker-container:"), "invalid container id: ");
        assert_eq!(msg("ssh:-oProxyCommand=touch /tmp/pwned"), "invalid ssh target: -oProxyCommand=touch /tmp/pwned");
        assert_eq!(msg("ssh:user@host;rm"), "invalid ssh target: user@host;rm");
        assert_eq!(msg("fake:does-not-exist"), "unknown tool runtime: fake:does-not-exist");
        assert_eq!(RuntimeSpec::parse("podman-container:abc_1.2-x").unwrap(), RuntimeSpec::Attach { engine: "podman", id: "abc_1.2-x".into() });
        assert_eq!(RuntimeSpec::parse("docker:busybox").unwrap(), RuntimeSpec::Spawn { engine: "docker", image: "busybox".into() });
        assert_eq!(RuntimeSpec::parse("ssh:me@box.lan").unwrap(), RuntimeSpec::Ssh { target: "me@box.lan".into() });
    }

    #[test]
    fn a_call_may_attach_but_never_spawn() {
        let err = for_call("", "docker:busybox").err().unwrap();
        assert_eq!(err.to_string(), "tool runtime must name a running container: docker:busybox");
        assert!(!for_call("", "").unwrap().is_isolated());
    }

    #[test]
    fn transports_keep_the_target_apart_from_the_command() {
        let inner = strings(&["sh", "-c", "echo 'hi'", "_", "a b"]);
        let ssh = Transport::Ssh { target: "me@box".into() }.argv(&inner, false);
        assert_eq!(&ssh[ssh.len() - 3..], ["-n", "me@box", r"'sh' '-c' 'echo '\''hi'\''' '_' 'a b'"]);
        let docker = Transport::Container { engine: "docker", id: "abc".into() }.argv(&inner, true);
        assert_eq!(&docker[..4], ["docker", "exec", "-i", "abc"]);
        assert_eq!(&docker[4..], inner.as_slice());
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("strata-tools-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn walk_lists_junk_dirs_without_entering_them_and_honours_depth() {
        let dir = scratch("walk");
        fs::create_dir_all(dir.join("build/nested")).unwrap();
        fs::create_dir_all(dir.join("src/deep")).unwrap();
        fs::write(dir.join("build/artifact.txt"), "x").unwrap();
        fs::write(dir.join("src/main.cpp"), "x").unwrap();
        fs::write(dir.join("src/deep/x.h"), "x").unwrap();
        fs::write(dir.join("top.txt"), "x").unwrap();
        let far = Instant::now() + LIST_TIMEOUT;
        let rels = |l: Listing| l.entries.into_iter().map(|e| e.rel).collect::<Vec<_>>();

        let all = rels(walk(&dir, 0, ListKind::All, far));
        assert_eq!(all, ["build", "src", "top.txt", "src/deep", "src/main.cpp", "src/deep/x.h"]);
        assert_eq!(rels(walk(&dir, 1, ListKind::Dirs, far)), ["build", "src"]);
        assert_eq!(rels(walk(&dir, 2, ListKind::Files, far)), ["top.txt", "src/main.cpp"]);
        assert!(walk(&dir, 0, ListKind::All, Instant::now()).truncated);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn host_io_reads_and_writes_relative_to_its_cwd() {
        let dir = scratch("hostio");
        let io = for_call(dir.to_str().unwrap(), "").unwrap();
        assert!(io.write("sub/out.txt", b"written"));
        assert_eq!(fs::read(dir.join("sub/out.txt")).unwrap(), b"written");
        assert_eq!(io.read("sub/out.txt").unwrap(), b"written");
        assert_eq!(io.file_size("sub/out.txt"), Some(7));
        assert!(io.is_dir("sub") && !io.is_file("sub") && io.is_file("sub/out.txt"));
        assert!(io.list(&io.resolve("missing"), 0, ListKind::All).is_none());
        let _ = fs::remove_dir_all(&dir);
    }
}
