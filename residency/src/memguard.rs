//! The memory guard: decides whether a RAM copy of the cold experts fits before it is allocated.
//!
//! Algorithm: the available memory is the minimum of the host's `MemAvailable` and, for every
//! ancestor of this process's cgroup-v2 group that has a finite limit, that limit minus the
//! group's usage that cannot be reclaimed. Only clean file cache counts as reclaimable:
//! `inactive_file - file_dirty - file_writeback`, clamped to `0..=memory.current`. A group
//! whose `memory.high` is below its `memory.max` is bounded by `memory.high`, because above it
//! the kernel throttles the group's allocations and reclaims aggressively, so it is the limit
//! that a copy actually runs into. This is the kubelet's "working set" (usage minus
//! inactive file pages), made stricter by not counting dirty or writeback pages as reclaimable.
//!
//! A request is admitted when `request + headroom <= available`. A pageable copy
//! (`--resident-cpu-experts`) keeps [`HEADROOM`] (8 GiB) free for the rest of the process and
//! the system. A page-locked copy (`--resident-experts`) needs [`PINNED_EXTRA_HEADROOM`]
//! (4 GiB) more on top, 12 GiB in all, because locked pages can never be reclaimed or swapped
//! when memory gets tight later.
//!
//! The guard measures; it cannot reserve. Allocations by other processes, or by this one, that
//! happen after the measurement are not accounted for.
//!
//! Where the cgroup-v2 group comes from: `/proc/self/cgroup` names the process's group as
//! `0::/path`, relative to the root of its cgroup namespace. `/proc/self/mountinfo` gives each
//! `cgroup2` mount's root in the same coordinates. With a private cgroup namespace (the usual
//! container) the mount root is `/` and the path is used as is below the mount point. Without
//! one, a container often sees only its own group bind-mounted, with a mount root such as
//! `/docker/abc`; the path must then lie below that root and the part below it is used. The
//! walk goes from the process's group up to the mount point and never above it: limits of
//! groups outside the mount or the namespace are invisible, and only the host `MemAvailable`
//! (which inside a container usually shows the whole machine) bounds them.
//!
//! A group without `memory.max` has no memory controller enabled (the hierarchy root never
//! has one) and so imposes no limit. Everything else fails closed: no `cgroup2` mount, a
//! memory controller bound to a cgroup-v1 hierarchy, an unreadable or garbled file, or a
//! non-Linux host all refuse the copy rather than pass it unchecked.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Memory left free for everything else when a pageable expert copy is admitted.
pub const HEADROOM: u64 = 8 << 30;

/// Extra headroom for a page-locked copy, since locked pages can never be reclaimed.
pub const PINNED_EXTRA_HEADROOM: u64 = 4 << 30;

const KIB: u64 = 1 << 10;
const GIB: f64 = (1u64 << 30) as f64;

/// How the expert copy is held in RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// Ordinary pageable memory (`--resident-cpu-experts`).
    Pageable,
    /// Page-locked memory (`--resident-experts`).
    PageLocked,
}

impl CopyKind {
    /// Memory that must stay free after the copy is allocated.
    pub fn headroom(self) -> u64 {
        match self {
            CopyKind::Pageable => HEADROOM,
            CopyKind::PageLocked => HEADROOM + PINNED_EXTRA_HEADROOM,
        }
    }
}

impl fmt::Display for CopyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CopyKind::Pageable => "pageable",
            CopyKind::PageLocked => "page-locked",
        })
    }
}

#[derive(Debug, Error)]
pub enum GuardError {
    #[error("the memory guard only supports Linux")]
    UnsupportedOs,
    #[error("the memory guard needs cgroup v2: {0}")]
    NoCgroupV2(String),
    #[error("the memory guard needs readable cgroup-v2 files: cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("the memory guard cannot parse {}: {reason}", path.display())]
    Parse { path: PathBuf, reason: String },
    #[error(
        "not enough memory for a {kind} copy of {} plus {} headroom: only {} available, \
         bounded by {what}: {detail}",
        gib(*request),
        gib(*headroom),
        gib(*available)
    )]
    Refused { kind: CopyKind, request: u64, headroom: u64, available: u64, what: String, detail: String },
}

/// One upper bound on the memory available to this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound {
    /// `"host MemAvailable"` or `"cgroup /a/b"`.
    pub what: String,
    pub available: u64,
    /// How `available` was derived, for messages.
    pub detail: String,
}

/// The result of one measurement: every bound found and the smallest of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub available: u64,
    /// The host bound first, then the limited cgroups from the process's own group upwards.
    pub bounds: Vec<Bound>,
    /// Index into `bounds` of the bound that sets `available`.
    pub tightest: usize,
}

impl Report {
    fn from_bounds(bounds: Vec<Bound>) -> Report {
        let mut tightest = 0;
        for (i, bound) in bounds.iter().enumerate() {
            if bound.available < bounds[tightest].available {
                tightest = i;
            }
        }
        let available = bounds.get(tightest).map_or(0, |b| b.available);
        Report { available, bounds, tightest }
    }

    /// Admits a copy of `request` bytes if it leaves the kind's headroom free.
    pub fn admit(&self, request: u64, kind: CopyKind) -> Result<(), GuardError> {
        let headroom = kind.headroom();
        let fits = request.checked_add(headroom).is_some_and(|need| need <= self.available);
        if fits {
            return Ok(());
        }
        let (what, detail) = match self.bounds.get(self.tightest) {
            Some(b) => (b.what.clone(), b.detail.clone()),
            None => ("nothing measured".to_string(), String::new()),
        };
        Err(GuardError::Refused { kind, request, headroom, available: self.available, what, detail })
    }

    /// The most bytes a copy of `kind` may take and leave its headroom free.
    pub fn allowance(&self, kind: CopyKind) -> u64 {
        self.available.saturating_sub(kind.headroom())
    }

    /// One log line: the available memory, the bound that sets it, and the other bounds.
    pub fn summary(&self) -> String {
        let mut line = format!("memory guard: {} available", gib(self.available));
        if let Some(tight) = self.bounds.get(self.tightest) {
            line.push_str(&format!(", bounded by {} ({})", tight.what, tight.detail));
        }
        let others: Vec<String> =
            self.bounds.iter().enumerate().filter(|(i, _)| *i != self.tightest).map(|(_, b)| format!("{} {}", b.what, gib(b.available))).collect();
        if !others.is_empty() {
            line.push_str(&format!("; also {}", others.join(", ")));
        }
        line
    }
}

/// Measures this machine, reading `/proc` and the cgroup-v2 mount.
pub fn measure_host() -> Result<Report, GuardError> {
    if cfg!(target_os = "linux") {
        measure(Path::new("/"))
    } else {
        Err(GuardError::UnsupportedOs)
    }
}

/// Measures the Linux file tree under `root`: `/` in production, a fixture directory in tests.
pub fn measure(root: &Path) -> Result<Report, GuardError> {
    let meminfo_path = root.join("proc/meminfo");
    let host = read_parsed(&meminfo_path, parse_meminfo)?;
    let mut bounds = vec![Bound { what: "host MemAvailable".to_string(), available: host, detail: format!("MemAvailable {}", gib(host)) }];

    let cgroup_path = root.join("proc/self/cgroup");
    let own = read_parsed(&cgroup_path, parse_self_cgroup)?;
    if let Some(v1) = &own.v1_memory {
        return Err(GuardError::NoCgroupV2(format!("the memory controller is bound to a cgroup-v1 hierarchy (memory:{v1}), whose limits it does not read")));
    }
    let Some(process) = own.v2_path else {
        return Err(GuardError::NoCgroupV2(format!("{} has no cgroup-v2 (0::) entry", cgroup_path.display())));
    };
    let process_parts = components(&process).ok_or_else(|| parse_err(&cgroup_path, format!("cgroup path {process:?} is not absolute")))?;
    if process_parts.contains(&"..") {
        return Err(GuardError::NoCgroupV2(format!("the process's cgroup {process} lies outside its cgroup namespace")));
    }

    let mountinfo_path = root.join("proc/self/mountinfo");
    let mounts = read_parsed(&mountinfo_path, parse_mountinfo)?;
    let (mount, below) = pick_mount(&mounts, &process_parts).ok_or_else(|| {
        GuardError::NoCgroupV2(if mounts.is_empty() {
            format!("no cgroup2 mount in {}", mountinfo_path.display())
        } else {
            format!("no cgroup2 mount in {} contains the process's cgroup {process}", mountinfo_path.display())
        })
    })?;

    let mount_dir = root.join(mount.mount_point.trim_start_matches('/'));
    let mount_root_parts = components(&mount.root).unwrap_or_default();
    for depth in (0..=below.len()).rev() {
        let mut dir = mount_dir.clone();
        dir.extend(&below[..depth]);
        let name: Vec<&str> = mount_root_parts.iter().chain(&below[..depth]).copied().collect();
        let what = format!("cgroup /{}", name.join("/"));
        if let Some(bound) = read_cgroup(&dir)?.and_then(|memory| memory.bound(&what)) {
            bounds.push(bound);
        }
    }
    Ok(Report::from_bounds(bounds))
}

/// The chosen mount and the process's cgroup path components below its root.
fn pick_mount<'a, 'p>(mounts: &'a [Cgroup2Mount], process: &[&'p str]) -> Option<(&'a Cgroup2Mount, Vec<&'p str>)> {
    let mut best: Option<(&Cgroup2Mount, usize)> = None;
    for mount in mounts {
        let Some(root) = components(&mount.root) else {
            continue;
        };
        let contains = root.len() <= process.len() && root.iter().zip(process).all(|(a, b)| a == b);
        let longer = match best {
            Some((_, len)) => root.len() > len,
            None => true,
        };
        if contains && longer {
            best = Some((mount, root.len()));
        }
    }
    best.map(|(mount, len)| (mount, process[len..].to_vec()))
}

/// The non-empty components of an absolute slash path, or `None` if it is relative.
fn components(path: &str) -> Option<Vec<&str>> {
    let rest = path.strip_prefix('/')?;
    Some(rest.split('/').filter(|p| !p.is_empty() && *p != ".").collect())
}

/// The memory files of one cgroup, `None` when it sets no finite limit.
fn read_cgroup(dir: &Path) -> Result<Option<CgroupMemory>, GuardError> {
    let max_path = dir.join("memory.max");
    let max = match read_optional(&max_path)? {
        None => return Ok(None),
        Some(text) => parse_limit(&text).map_err(|reason| parse_err(&max_path, reason))?,
    };
    let high_path = dir.join("memory.high");
    let high = match read_optional(&high_path)? {
        None => None,
        Some(text) => parse_limit(&text).map_err(|reason| parse_err(&high_path, reason))?,
    };
    if max.is_none() && high.is_none() {
        return Ok(None);
    }
    let current = read_parsed(&dir.join("memory.current"), parse_bytes)?;
    let stat = read_parsed(&dir.join("memory.stat"), parse_memory_stat)?;
    Ok(Some(CgroupMemory { max, high, current, stat }))
}

fn read(path: &Path) -> Result<String, GuardError> {
    std::fs::read_to_string(path).map_err(|source| GuardError::Read { path: path.to_path_buf(), source })
}

fn read_parsed<T>(path: &Path, parse: impl Fn(&str) -> Result<T, String>) -> Result<T, GuardError> {
    parse(&read(path)?).map_err(|reason| parse_err(path, reason))
}

fn read_optional(path: &Path) -> Result<Option<String>, GuardError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(GuardError::Read { path: path.to_path_buf(), source }),
    }
}

fn parse_err(path: &Path, reason: String) -> GuardError {
    GuardError::Parse { path: path.to_path_buf(), reason }
}

/// The memory state of one cgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CgroupMemory {
    max: Option<u64>,
    high: Option<u64>,
    current: u64,
    stat: FileStat,
}

impl CgroupMemory {
    /// The bound this group sets, `None` when it has no finite limit.
    fn bound(&self, what: &str) -> Option<Bound> {
        let (limit, limit_desc) = match (self.max, self.high) {
            (None, None) => return None,
            (Some(max), Some(high)) if high < max => (high, format!("memory.high {} (below memory.max {})", gib(high), gib(max))),
            (None, Some(high)) => (high, format!("memory.high {}", gib(high))),
            (Some(max), _) => (max, format!("limit {}", gib(max))),
        };
        let reclaimable = self.stat.clean_inactive().min(self.current);
        let pinned_usage = self.current - reclaimable;
        Some(Bound {
            what: what.to_string(),
            available: limit.saturating_sub(pinned_usage),
            detail: format!("{limit_desc}, usage {} of which {} reclaimable clean file cache", gib(self.current), gib(reclaimable)),
        })
    }
}

/// The `memory.stat` counters the guard uses, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileStat {
    pub inactive_file: u64,
    pub file_dirty: u64,
    pub file_writeback: u64,
}

impl FileStat {
    /// Inactive file cache that can be dropped without writing anything back.
    pub fn clean_inactive(&self) -> u64 {
        self.inactive_file.saturating_sub(self.file_dirty).saturating_sub(self.file_writeback)
    }
}

/// This process's entries in `/proc/self/cgroup`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SelfCgroup {
    /// The path of the cgroup-v2 (`0::`) entry.
    pub v2_path: Option<String>,
    /// The path of a cgroup-v1 entry whose controllers include `memory`.
    pub v1_memory: Option<String>,
}

/// A `cgroup2` entry of `/proc/self/mountinfo`, escapes decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cgroup2Mount {
    /// The cgroup this mount shows, relative to the cgroup namespace root.
    pub root: String,
    pub mount_point: String,
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn parse_meminfo(text: &str) -> Result<u64, String> {
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("MemAvailable:") else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let value = fields.next().ok_or("MemAvailable has no value")?;
        let kib: u64 = value.parse().map_err(|_| format!("MemAvailable value {value:?} is not a number"))?;
        return match (fields.next(), fields.next()) {
            (Some("kB"), None) => kib.checked_mul(KIB).ok_or_else(|| format!("MemAvailable {kib} kB overflows")),
            _ => Err(format!("MemAvailable line {line:?} is not in kB")),
        };
    }
    Err("no MemAvailable line".to_string())
}

/// `inactive_file`, `file_dirty` and `file_writeback` from a cgroup's `memory.stat`.
pub fn parse_memory_stat(text: &str) -> Result<FileStat, String> {
    let (mut inactive, mut dirty, mut writeback) = (None, None, None);
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(key), Some(value), None) = (fields.next(), fields.next(), fields.next()) else {
            if line.trim().is_empty() {
                continue;
            }
            return Err(format!("line {line:?} is not `key value`"));
        };
        let slot = match key {
            "inactive_file" => &mut inactive,
            "file_dirty" => &mut dirty,
            "file_writeback" => &mut writeback,
            _ => continue,
        };
        *slot = Some(value.parse::<u64>().map_err(|_| format!("{key} value {value:?} is not a number"))?);
    }
    let need = |value: Option<u64>, key: &str| value.ok_or_else(|| format!("no {key} line"));
    Ok(FileStat { inactive_file: need(inactive, "inactive_file")?, file_dirty: need(dirty, "file_dirty")?, file_writeback: need(writeback, "file_writeback")? })
}

/// The cgroup-v2 path and any cgroup-v1 memory path from `/proc/self/cgroup`.
pub fn parse_self_cgroup(text: &str) -> Result<SelfCgroup, String> {
    let mut own = SelfCgroup::default();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            return Err(format!("line {line:?} is not `id:controllers:path`"));
        };
        if id == "0" && controllers.is_empty() {
            own.v2_path = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            own.v1_memory = Some(path.to_string());
        }
    }
    Ok(own)
}

/// The `cgroup2` mounts listed in `/proc/self/mountinfo`, in file order.
pub fn parse_mountinfo(text: &str) -> Result<Vec<Cgroup2Mount>, String> {
    let mut mounts = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let separator = fields.iter().skip(6).position(|f| *f == "-").map(|i| i + 6);
        let (Some(sep), Some(root), Some(mount_point)) = (separator, fields.get(3), fields.get(4)) else {
            return Err(format!("line {line:?} is not a mountinfo entry"));
        };
        let Some(fstype) = fields.get(sep + 1) else {
            return Err(format!("line {line:?} has no filesystem type"));
        };
        if *fstype == "cgroup2" {
            mounts.push(Cgroup2Mount { root: unescape(root)?, mount_point: unescape(mount_point)? });
        }
    }
    Ok(mounts)
}

/// Decodes mountinfo's octal escapes such as `\040` for a space.
fn unescape(field: &str) -> Result<String, String> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            let code = bytes
                .get(i + 1..i + 4)
                .and_then(|d| std::str::from_utf8(d).ok())
                .filter(|d| d.bytes().all(|b| (b'0'..=b'7').contains(&b)))
                .and_then(|d| u8::from_str_radix(d, 8).ok())
                .ok_or_else(|| format!("bad escape in {field:?}"))?;
            out.push(code);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{field:?} decodes to invalid UTF-8"))
}

/// A `memory.max` or `memory.high` value: `None` for `max`, else the limit in bytes.
pub fn parse_limit(text: &str) -> Result<Option<u64>, String> {
    match text.trim() {
        "max" => Ok(None),
        _ => parse_bytes(text).map(Some),
    }
}

fn parse_bytes(text: &str) -> Result<u64, String> {
    let value = text.trim();
    value.parse().map_err(|_| format!("{value:?} is not a byte count"))
}

/// Feeds arbitrary bytes to every parser and to the bound arithmetic; used by the fuzz target.
pub fn fuzz_parsers(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = parse_meminfo(&text);
    let _ = parse_self_cgroup(&text);
    let _ = parse_mountinfo(&text);
    let _ = parse_limit(&text);
    if let Ok(stat) = parse_memory_stat(&text) {
        let memory = CgroupMemory { max: Some(stat.file_writeback), high: Some(stat.file_dirty), current: stat.inactive_file, stat };
        if let Some(bound) = memory.bound("cgroup /fuzz") {
            let report = Report::from_bounds(vec![bound]);
            let _ = report.admit(stat.inactive_file, CopyKind::PageLocked);
            let _ = report.summary();
        }
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use tempfile::TempDir;

    const G: u64 = 1 << 30;
    const HOST_MOUNTINFO: &str = "\
22 1 0:21 / /proc rw,nosuid - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
";

    struct Tree {
        dir: TempDir,
    }

    impl Tree {
        fn new(mem_available: u64, self_cgroup: &str, mountinfo: &str) -> Tree {
            let tree = Tree { dir: TempDir::new().unwrap() };
            tree.write("proc/meminfo", &format!("MemTotal: 1 kB\nMemAvailable: {} kB\n", mem_available / KIB));
            tree.write("proc/self/cgroup", self_cgroup);
            tree.write("proc/self/mountinfo", mountinfo);
            tree
        }

        fn host(mem_available: u64, cgroup: &str) -> Tree {
            Tree::new(mem_available, &format!("0::{cgroup}\n"), HOST_MOUNTINFO)
        }

        fn write(&self, rel: &str, text: &str) {
            let path = self.dir.path().join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }

        fn unlimited(&self, group: &str) {
            self.write(&format!("{group}/memory.max"), "max\n");
            self.write(&format!("{group}/memory.high"), "max\n");
        }

        fn limited(&self, group: &str, max: u64, current: u64, stat: [u64; 3]) {
            self.write(&format!("{group}/memory.max"), &format!("{max}\n"));
            self.write(&format!("{group}/memory.high"), "max\n");
            self.write(&format!("{group}/memory.current"), &format!("{current}\n"));
            self.write(
                &format!("{group}/memory.stat"),
                &format!("anon 1\nfile 2\ninactive_file {}\nactive_file 3\nfile_dirty {}\nfile_writeback {}\n", stat[0], stat[1], stat[2]),
            );
        }

        fn measure(&self) -> Result<Report, GuardError> {
            measure(self.dir.path())
        }
    }

    fn tightest(report: &Report) -> &Bound {
        &report.bounds[report.tightest]
    }

    #[test]
    fn no_limits_leaves_the_host_bound() {
        let tree = Tree::host(100 * G, "/user.slice/app");
        tree.unlimited("sys/fs/cgroup/user.slice");
        tree.unlimited("sys/fs/cgroup/user.slice/app");
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 100 * G);
        assert_eq!(report.bounds.len(), 1);
        assert_eq!(tightest(&report).what, "host MemAvailable");
    }

    #[test]
    fn single_finite_limit() {
        let tree = Tree::host(100 * G, "/user.slice/app");
        tree.unlimited("sys/fs/cgroup/user.slice");
        tree.limited("sys/fs/cgroup/user.slice/app", 32 * G, 20 * G, [3 * G, 0, 0]);
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 15 * G);
        let bound = tightest(&report);
        assert_eq!(bound.what, "cgroup /user.slice/app");
        assert_eq!(bound.detail, "limit 32.0 GiB, usage 20.0 GiB of which 3.0 GiB reclaimable clean file cache");
    }

    #[test]
    fn parent_tighter_than_child() {
        let tree = Tree::host(100 * G, "/a/b");
        tree.limited("sys/fs/cgroup/a", 20 * G, 12 * G, [0, 0, 0]);
        tree.limited("sys/fs/cgroup/a/b", 40 * G, 10 * G, [0, 0, 0]);
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 8 * G);
        assert_eq!(tightest(&report).what, "cgroup /a");
        let names: Vec<&str> = report.bounds.iter().map(|b| b.what.as_str()).collect();
        assert_eq!(names, ["host MemAvailable", "cgroup /a/b", "cgroup /a"]);
    }

    #[test]
    fn child_tighter_than_parent() {
        let tree = Tree::host(100 * G, "/a/b");
        tree.limited("sys/fs/cgroup/a", 40 * G, 12 * G, [0, 0, 0]);
        tree.limited("sys/fs/cgroup/a/b", 16 * G, 10 * G, [0, 0, 0]);
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 6 * G);
        assert_eq!(tightest(&report).what, "cgroup /a/b");
    }

    #[test]
    fn dirty_and_writeback_cache_is_not_reclaimable() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 30 * G, [10 * G, 6 * G, 3 * G]);
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 3 * G);

        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 30 * G, [10 * G, 8 * G, 8 * G]);
        assert_eq!(tree.measure().unwrap().available, 2 * G);
    }

    #[test]
    fn reclaimable_is_capped_by_usage() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 5 * G, [50 * G, 0, 0]);
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 32 * G);
    }

    #[test]
    fn usage_above_limit_leaves_nothing() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 8 * G, 10 * G, [0, 0, 0]);
        assert_eq!(tree.measure().unwrap().available, 0);
    }

    #[test]
    fn host_tighter_than_cgroups() {
        let tree = Tree::host(10 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 64 * G, 4 * G, [0, 0, 0]);
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 10 * G);
        assert_eq!(report.tightest, 0);
        assert_eq!(report.bounds.len(), 2);
    }

    #[test]
    fn memory_high_below_max_is_the_limit() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 4 * G, [0, 0, 0]);
        tree.write("sys/fs/cgroup/a/memory.high", &format!("{}\n", 24 * G));
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 20 * G);
        assert!(tightest(&report).detail.starts_with("memory.high 24.0 GiB (below memory.max 32.0 GiB)"));

        tree.write("sys/fs/cgroup/a/memory.max", "max\n");
        assert_eq!(tree.measure().unwrap().available, 20 * G);

        tree.write("sys/fs/cgroup/a/memory.high", &format!("{}\n", 40 * G));
        tree.write("sys/fs/cgroup/a/memory.max", &format!("{}\n", 32 * G));
        assert_eq!(tree.measure().unwrap().available, 28 * G);
    }

    #[test]
    fn container_mount_root_below_the_namespace_root() {
        let mountinfo = "1000 900 0:30 /docker/abc /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n";
        let tree = Tree::new(100 * G, "0::/docker/abc/worker\n", mountinfo);
        tree.limited("sys/fs/cgroup", 16 * G, 4 * G, [0, 0, 0]);
        tree.unlimited("sys/fs/cgroup/worker");
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 12 * G);
        assert_eq!(tightest(&report).what, "cgroup /docker/abc");

        let tree = Tree::new(100 * G, "0::/other\n", mountinfo);
        let err = tree.measure().unwrap_err().to_string();
        assert!(err.contains("contains the process's cgroup /other"), "{err}");
    }

    #[test]
    fn private_namespace_and_escaped_mount_point() {
        let mountinfo = "1000 900 0:30 / /my\\040cgroups rw - cgroup2 cgroup2 rw\n";
        let tree = Tree::new(100 * G, "0::/\n", mountinfo);
        tree.limited("my cgroups", 16 * G, 4 * G, [0, 0, 0]);
        let report = tree.measure().unwrap();
        assert_eq!(report.available, 12 * G);
        assert_eq!(tightest(&report).what, "cgroup /");
    }

    #[test]
    fn root_without_memory_files_is_unlimited() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 4 * G, [0, 0, 0]);
        assert_eq!(tree.measure().unwrap().available, 28 * G);
    }

    #[test]
    fn cgroup_v1_only_is_refused() {
        let self_cgroup = "4:memory:/user.slice\n3:cpu,cpuacct:/\n";
        let mountinfo = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let err = Tree::new(100 * G, self_cgroup, mountinfo).measure().unwrap_err();
        assert!(matches!(err, GuardError::NoCgroupV2(_)), "{err}");
        assert!(err.to_string().contains("cgroup-v1"), "{err}");

        let err = Tree::new(100 * G, "3:cpu,cpuacct:/\n", mountinfo).measure().unwrap_err();
        assert!(err.to_string().contains("no cgroup-v2 (0::) entry"), "{err}");
    }

    #[test]
    fn hybrid_hierarchy_with_v1_memory_is_refused() {
        let self_cgroup = "4:memory:/batch\n0::/\n";
        let err = Tree::new(100 * G, self_cgroup, HOST_MOUNTINFO).measure().unwrap_err();
        assert!(matches!(err, GuardError::NoCgroupV2(_)), "{err}");
    }

    #[test]
    fn no_cgroup2_mount_is_refused() {
        let tree = Tree::new(100 * G, "0::/a\n", "22 1 0:21 / /proc rw - proc proc rw\n");
        let err = tree.measure().unwrap_err().to_string();
        assert!(err.contains("no cgroup2 mount"), "{err}");
    }

    #[test]
    fn missing_memory_stat_is_refused() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 4 * G, [0, 0, 0]);
        fs::remove_file(tree.dir.path().join("sys/fs/cgroup/a/memory.stat")).unwrap();
        let err = tree.measure().unwrap_err();
        assert!(matches!(err, GuardError::Read { .. }), "{err}");
        assert!(err.to_string().contains("sys/fs/cgroup/a/memory.stat"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn unreadable_file_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 4 * G, [0, 0, 0]);
        let stat = tree.dir.path().join("sys/fs/cgroup/a/memory.stat");
        fs::set_permissions(&stat, fs::Permissions::from_mode(0o000)).unwrap();
        if fs::read(&stat).is_ok() {
            eprintln!("skipped: this user can read a mode-000 file");
            return;
        }
        let err = tree.measure().unwrap_err().to_string();
        assert!(err.contains("needs readable cgroup-v2 files: cannot read"), "{err}");
        assert!(err.contains("memory.stat"), "{err}");
    }

    #[test]
    fn garbled_numbers_are_refused() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 4 * G, [0, 0, 0]);
        tree.write("sys/fs/cgroup/a/memory.current", "12x\n");
        let err = tree.measure().unwrap_err();
        assert!(matches!(err, GuardError::Parse { .. }), "{err}");
        assert!(err.to_string().contains("memory.current"), "{err}");

        tree.write("sys/fs/cgroup/a/memory.current", "4\n");
        tree.write("sys/fs/cgroup/a/memory.max", "-1\n");
        assert!(matches!(tree.measure(), Err(GuardError::Parse { .. })));

        tree.write("sys/fs/cgroup/a/memory.max", "max\n");
        tree.write("sys/fs/cgroup/a/memory.high", "1000\n");
        tree.write("sys/fs/cgroup/a/memory.stat", "inactive_file 1\nfile_dirty lots\nfile_writeback 0\n");
        assert!(matches!(tree.measure(), Err(GuardError::Parse { .. })));

        tree.write("proc/meminfo", "MemAvailable: 18446744073709551615 kB\n");
        assert!(matches!(tree.measure(), Err(GuardError::Parse { .. })));
    }

    #[test]
    fn admit_at_the_headroom_boundary() {
        let report = Report::from_bounds(vec![Bound { what: "cgroup /a".to_string(), available: 40 * G, detail: "limit 40.0 GiB".to_string() }]);
        assert!(report.admit(32 * G, CopyKind::Pageable).is_ok());
        assert!(report.admit(32 * G + 1, CopyKind::Pageable).is_err());
        assert!(report.admit(28 * G, CopyKind::PageLocked).is_ok());
        assert!(report.admit(28 * G + 1, CopyKind::PageLocked).is_err());
        assert!(report.admit(u64::MAX, CopyKind::Pageable).is_err());

        let err = report.admit(30 * G, CopyKind::PageLocked).unwrap_err().to_string();
        assert_eq!(
            err,
            "not enough memory for a page-locked copy of 30.0 GiB plus 12.0 GiB headroom: \
             only 40.0 GiB available, bounded by cgroup /a: limit 40.0 GiB"
        );

        let small = Report::from_bounds(vec![Bound { what: "x".into(), available: 4 * G, detail: String::new() }]);
        assert!(small.admit(0, CopyKind::Pageable).is_err());
    }

    #[test]
    fn summary_names_the_tightest_bound() {
        let tree = Tree::host(100 * G, "/a");
        tree.limited("sys/fs/cgroup/a", 32 * G, 4 * G, [0, 0, 0]);
        let summary = tree.measure().unwrap().summary();
        assert_eq!(
            summary,
            "memory guard: 28.0 GiB available, bounded by cgroup /a (limit 32.0 GiB, usage 4.0 GiB of \
             which 0.0 GiB reclaimable clean file cache); also host MemAvailable 100.0 GiB"
        );
    }

    #[test]
    fn parsers() {
        assert_eq!(parse_meminfo("MemTotal: 9 kB\nMemAvailable:   2 kB\n"), Ok(2048));
        assert!(parse_meminfo("MemAvailable: 2 MB\n").is_err());
        assert!(parse_meminfo("MemFree: 2 kB\n").is_err());
        assert_eq!(parse_limit("max\n"), Ok(None));
        assert_eq!(parse_limit("4096\n"), Ok(Some(4096)));
        assert!(parse_limit("").is_err());
        assert!(parse_memory_stat("inactive_file 1\nfile_dirty 2\n").is_err());
        let own = parse_self_cgroup("0::/a:b c\n").unwrap();
        assert_eq!(own.v2_path.as_deref(), Some("/a:b c"));
        assert!(parse_self_cgroup("garbage\n").is_err());
        let mounts = parse_mountinfo("1 2 0:3 /a\\134b /m\\011t rw shared:1 master:2 - cgroup2 none rw\n").unwrap();
        assert_eq!(mounts, [Cgroup2Mount { root: "/a\\b".into(), mount_point: "/m\tt".into() }]);
        assert!(parse_mountinfo("1 2 0:3 / /m rw - \n").is_err());
        assert!(parse_mountinfo("1 2 0:3 /\\04 /m rw - cgroup2 x rw\n").is_err());
        fuzz_parsers(b"inactive_file 18446744073709551615\nfile_dirty 0\nfile_writeback 0\n");
    }

    #[test]
    fn measure_this_host() {
        match measure_host() {
            Ok(report) => eprintln!("{}", report.summary()),
            Err(err) => {
                eprintln!("refused: {err}");
                assert!(!matches!(err, GuardError::Refused { .. }));
            }
        }
    }
}
