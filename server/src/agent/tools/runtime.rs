//! `--tools-runtime`: the isolate every tool call runs in unless the request names its own.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use super::io::RuntimeSpec;
use super::ToolError;

const CIDFILE_POLL: Duration = Duration::from_millis(100);
const CIDFILE_POLLS: usize = 100;

pub enum Runtime {
    /// A target that already exists (a running container, an ssh host): passed through as is.
    Existing(String),
    /// A container this server started and stops when it exits.
    Owned(Mutex<OwnedContainer>),
}

impl Runtime {
    /// Checked at startup, so a bad spec stops the server instead of failing every call.
    pub fn from_spec(spec: &str) -> Result<Self, ToolError> {
        match RuntimeSpec::parse(spec)? {
            RuntimeSpec::Spawn { engine, image } if image.is_empty() => {
                Err(ToolError::Failed(format!("--tools-runtime {engine}:<image> requires an image name")))
            }
            RuntimeSpec::Spawn { engine, image } => Ok(Self::Owned(Mutex::new(OwnedContainer::spawn(engine, image)?))),
            RuntimeSpec::Attach { .. } | RuntimeSpec::Ssh { .. } => Ok(Self::Existing(spec.to_string())),
        }
    }

    /// The `x-tool-runtime` value a call uses; a container that died on its own is respawned.
    pub fn spec(&self) -> Result<String, ToolError> {
        match self {
            Self::Existing(spec) => Ok(spec.clone()),
            Self::Owned(container) => {
                let mut c = container.lock().unwrap_or_else(|p| p.into_inner());
                if !c.alive() {
                    crate::log::srv(strata_ffi::Verbosity::Info, "tools", &format!("{} tools runtime container \"{}\" died, respawning", c.engine, c.id));
                    let fresh = OwnedContainer::spawn(c.engine, c.image.clone())?;
                    *c = fresh;
                }
                Ok(format!("{}-container:{}", c.engine, c.id))
            }
        }
    }
}

/// `<engine> run --rm -i <image> sh` with its stdin held open: the shell, the container's
/// pid 1, waits on it, so closing it (on drop, or when this process dies) ends the container
/// and `--rm` removes it.
pub struct OwnedContainer {
    engine: &'static str,
    image: String,
    id: String,
    client: Child,
}

impl OwnedContainer {
    fn spawn(engine: &'static str, image: String) -> Result<Self, ToolError> {
        let cidfile = cidfile_path();
        let _ = fs::remove_file(&cidfile);
        let mut client = Command::new(engine)
            .args(["run", "--rm", "-i", "--cidfile"])
            .arg(&cidfile)
            .args([image.as_str(), "sh"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|_| ToolError::Failed(format!("failed to spawn {engine} container for tools runtime (image: {image})")))?;

        let mut id = String::new();
        for _ in 0..CIDFILE_POLLS {
            id = fs::read_to_string(&cidfile).map(|s| s.lines().next().unwrap_or("").to_string()).unwrap_or_default();
            if !id.is_empty() {
                break;
            }
            thread::sleep(CIDFILE_POLL);
        }
        let _ = fs::remove_file(&cidfile);
        if id.is_empty() {
            let _ = client.kill();
            let _ = client.wait();
            return Err(ToolError::Failed(format!("timed out waiting for {engine} container to start (image: {image})")));
        }
        Ok(Self { engine, image, id, client })
    }

    fn alive(&mut self) -> bool {
        matches!(self.client.try_wait(), Ok(None))
    }
}

impl Drop for OwnedContainer {
    fn drop(&mut self) {
        drop(self.client.stdin.take());
        let _ = self.client.wait();
    }
}

fn cidfile_path() -> PathBuf {
    let unique = format!("strata-tools-runtime-cid-{}-{:?}.tmp", std::process::id(), thread::current().id());
    std::env::temp_dir().join(unique.replace(['(', ')'], ""))
}
