//! Child processes for the tools: output read as raw bytes as soon as it is ready, capped in
//! size, with a wall-clock limit and early termination when the caller stops listening.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const READ_CHUNK: usize = 4096;
/// How long output is still collected after the child was killed: a grandchild that inherited
/// the pipe may keep it open, and must not hold the request.
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(2);
/// What a child killed by a signal reports, as llama.cpp's subprocess helper does.
const SIGNALLED_EXIT_CODE: i32 = 1;

#[derive(Debug, Default)]
pub struct ExecResult {
    pub output: Vec<u8>,
    pub exit_code: i32,
    pub timed_out: bool,
}

impl ExecResult {
    pub fn ok(&self) -> bool {
        self.exit_code == 0 && !self.timed_out
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.output).into_owned()
    }
}

pub struct Spawn<'a> {
    pub argv: &'a [String],
    pub cwd: Option<&'a str>,
    pub stdin: Option<&'a [u8]>,
    /// stderr joins stdout; off when stdout carries data (file contents) stderr must not taint.
    pub combine_stderr: bool,
    pub max_output: usize,
    pub timeout: Duration,
}

/// Sees each piece of output within the cap as it arrives; returning false kills the child.
pub type OnChunk<'a> = Option<&'a mut dyn FnMut(&[u8]) -> bool>;

pub fn run(spec: &Spawn<'_>, mut on_chunk: OnChunk<'_>) -> ExecResult {
    let failed = ExecResult { output: b"failed to spawn process".to_vec(), exit_code: -1, timed_out: false };
    let Some((program, args)) = spec.argv.split_first() else {
        return failed;
    };
    let mut cmd = Command::new(program);
    cmd.args(args).stdin(if spec.stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(if spec.combine_stderr {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    if let Some(cwd) = spec.cwd.filter(|c| !c.is_empty()) {
        cmd.current_dir(cwd);
    }
    let Ok(mut child) = cmd.spawn() else {
        return failed;
    };

    if let (Some(data), Some(mut stdin)) = (spec.stdin, child.stdin.take()) {
        let data = data.to_vec();
        // a short write is not an error by itself: the exit code decides
        thread::spawn(move || {
            let _ = stdin.write_all(&data);
        });
    }

    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    if let Some(out) = child.stdout.take() {
        spawn_reader(out, tx.clone());
    }
    if let Some(err) = child.stderr.take() {
        spawn_reader(err, tx.clone());
    }
    drop(tx);

    let deadline = Instant::now() + spec.timeout;
    let mut drain_until: Option<Instant> = None;
    let mut res = ExecResult::default();
    let mut truncated = false;
    loop {
        let now = Instant::now();
        let wait_until = drain_until.unwrap_or(deadline);
        if now >= wait_until {
            if drain_until.is_some() {
                break;
            }
            res.timed_out = true;
            let _ = child.kill();
            drain_until = Some(now + DRAIN_AFTER_KILL);
            continue;
        }
        let chunk = match rx.recv_timeout(wait_until - now) {
            Ok(c) => c,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        if truncated {
            continue;
        }
        let room = spec.max_output - res.output.len();
        let take = chunk.len().min(room);
        res.output.extend_from_slice(&chunk[..take]);
        truncated = take < chunk.len();
        if let Some(cb) = on_chunk.as_mut() {
            if take > 0 && !cb(&chunk[..take]) && !truncated {
                let _ = child.kill();
                drain_until.get_or_insert(Instant::now() + DRAIN_AFTER_KILL);
                break;
            }
        }
    }

    if drain_until.is_some() {
        let _ = child.kill();
    }
    res.exit_code = child.wait().ok().and_then(|s| s.code()).unwrap_or(SIGNALLED_EXIT_CODE);
    if truncated {
        res.output.extend_from_slice(b"\n[output truncated]");
    }
    res
}

fn spawn_reader(mut pipe: impl Read + Send + 'static, tx: mpsc::Sender<Vec<u8>>) {
    thread::spawn(move || {
        let mut buf = [0u8; READ_CHUNK];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    // keep draining after the receiver is gone, else the child blocks on a full pipe
                    let _ = tx.send(buf[..n].to_vec());
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(cmd: &str, max_output: usize, timeout: Duration) -> ExecResult {
        let argv = ["sh".to_string(), "-c".to_string(), cmd.to_string()];
        run(&Spawn { argv: &argv, cwd: None, stdin: None, combine_stderr: true, max_output, timeout }, None)
    }

    #[test]
    fn combines_stderr_and_reports_exit_code() {
        let r = sh("echo out; echo err >&2; exit 3", 1024, Duration::from_secs(10));
        let text = r.text();
        assert!(text.contains("out\n") && text.contains("err\n"), "{text}");
        assert_eq!(r.exit_code, 3);
        assert!(!r.timed_out);
    }

    #[test]
    fn caps_output_and_marks_truncation() {
        let r = sh("printf 0123456789", 4, Duration::from_secs(10));
        assert_eq!(r.text(), "0123\n[output truncated]");
        assert_eq!(r.exit_code, 0);
    }

    #[test]
    fn times_out_even_when_a_grandchild_holds_the_pipe() {
        let start = Instant::now();
        let r = sh("sleep 30; echo never", 1024, Duration::from_millis(300));
        assert!(r.timed_out);
        assert_eq!(r.exit_code, SIGNALLED_EXIT_CODE);
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn feeds_stdin_and_reports_spawn_failure() {
        let argv = ["cat".to_string()];
        let spec = Spawn { argv: &argv, cwd: None, stdin: Some(b"piped"), combine_stderr: false, max_output: 64, timeout: Duration::from_secs(10) };
        assert_eq!(run(&spec, None).text(), "piped");
        let argv = ["/nonexistent/strata-no-such-binary".to_string()];
        let spec = Spawn { argv: &argv, ..spec };
        let r = run(&spec, None);
        assert_eq!((r.exit_code, r.text().as_str()), (-1, "failed to spawn process"));
    }

    #[test]
    fn callback_returning_false_stops_the_child() {
        let argv = ["sh".to_string(), "-c".to_string(), "echo first; sleep 30; echo second".to_string()];
        let spec = Spawn { argv: &argv, cwd: None, stdin: None, combine_stderr: true, max_output: 1024, timeout: Duration::from_secs(60) };
        let start = Instant::now();
        let mut stop = |_: &[u8]| false;
        let r = run(&spec, Some(&mut stop));
        assert_eq!(r.text(), "first\n");
        assert!(start.elapsed() < Duration::from_secs(10));
    }
}
