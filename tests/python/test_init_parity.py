"""What llama-server's common_init_from_params does besides loading the model and making the
context, which strata-server makes itself. Each test runs the same flags on upstream llama-server
(the pin, unpatched) and on strata-server over loopback HTTP and compares what they do."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import servers

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODELS = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models"))
LLAMA = MODELS / "tiny-llama.gguf"
RERANK = MODELS / "tiny-bert-rerank.gguf"
BINARIES = {"upstream": UPSTREAM, "strata": STRATA}
# tiny-llama: n_embd 64, 4 layers; a control vector has directions for layers 1..3
N_EMBD, N_LAYER = 64, 4
PROMPT = "The lighthouse keeper counted the ships"


def _gguf():
    sys.path.insert(0, str(REPO / "vendor" / "llama.cpp" / "gguf-py"))
    # gguf/metadata.py imports yaml at module level but only uses it for model cards
    sys.modules.setdefault("yaml", types.ModuleType("yaml"))
    import gguf
    return gguf


gguf = _gguf()


@pytest.fixture(scope="module", autouse=True)
def binaries():
    for p in (STRATA, UPSTREAM, LLAMA, RERANK):
        if not p.exists():
            pytest.fail(f"{p} is missing: run tools/setup, tools/build-upstream and cargo build --release")


class Running:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log_path = proc, url, log

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.load(r)

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)

    def tokens(self, prompt: str = PROMPT, n: int = 16, **extra) -> list[int]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True, "cache_prompt": False, **extra}
        return self.post("/completion", body)["tokens"]

    def threads(self) -> list[dict]:
        """Each thread's nice value and allowed CPUs (from /proc)."""
        out = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
                status = (task / "status").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            cpus = next(l.split(":", 1)[1].strip() for l in status.splitlines() if l.startswith("Cpus_allowed_list:"))
            out.append({"nice": int(fields[16]), "cpus": cpus})
        return out


@contextlib.contextmanager
def serve(which: str, args: list[str], tmp_path: Path):
    log = tmp_path / f"{which}-{time.monotonic_ns()}.log"
    with open(log, "wb", buffering=0) as f:
        proc, url = servers.start(BINARIES[which], ["--host", "127.0.0.1", *args], stderr=f)
    try:
        yield Running(proc, url, log)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def both(args: list[str], tmp_path: Path, probe):
    """probe(server) on upstream, then on strata, with the same flags."""
    out = {}
    for which in BINARIES:
        with serve(which, args, tmp_path) as s:
            out[which] = probe(s)
    return out["upstream"], out["strata"]


def base_args(model: Path = LLAMA) -> list[str]:
    return ["-m", str(model), "-c", "1024", "-np", "1", "-t", "2"]


def cmn_lines(log: str, *needles: str) -> list[str]:
    """The log's lines holding any of needles, without the timestamp and level columns."""
    lines = []
    for line in log.splitlines():
        if any(n in line for n in needles):
            lines.append(re.sub(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ", "", line))
    return lines


def copy_gguf(src: Path, dst: Path, edit) -> Path:
    """A copy of src, its metadata as edit(writer, fields) leaves it: fields maps each key of src
    to (value, type, array type) and may be changed; the writer takes keys of its own."""
    r = gguf.GGUFReader(str(src))
    arch = r.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(str(dst), arch)
    fields = {}
    for field in r.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        fields[field.name] = (field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    edit(w, fields)
    for name, (value, vtype, sub) in fields.items():
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    return dst


# ---- threadpools and priority ----------------------------------------------------------------

# Upstream's task-queue thread, started by its decoding thread after the warm-up, inherits that
# thread's priority and CPU mask: the tests compare the values the servers' threads take, and
# count strata's own (the engine thread and its OpenMP worker).

def test_prio_lowers_the_compute_threads_as_upstream_does(tmp_path):
    # -C pins the threads that compute, which tells them from the servers' other threads
    def niced(s: Running) -> list[int]:
        s.tokens()
        return [t["nice"] for t in s.threads() if t["cpus"] == "0"]
    up, st = both(base_args() + ["-C", "0x1", "--prio", "-1"], tmp_path, niced)
    assert set(up) == set(st) == {5} and len(st) == 2, (up, st)
    up, st = both(base_args() + ["-C", "0x1"], tmp_path, niced)
    assert set(up) == set(st) == {0} and len(st) == 2, (up, st)


def pinned(s: Running) -> list[str]:
    """The CPU lists of the threads whose affinity is narrower than the machine's."""
    everything = f"0-{os.cpu_count() - 1}"
    return sorted(t["cpus"] for t in s.threads() if t["cpus"] != everything)


@pytest.mark.parametrize("flags, cpus", [(["-C", "0x1"], {"0"}), (["-Cr", "1-1"], {"1"}), (["-C", "0x3", "--cpu-strict", "1"], {"0", "1"})],
                         ids=["mask", "range", "strict"])
def test_cpu_masks_pin_the_compute_threads_as_upstream_does(tmp_path, flags, cpus):
    def probe(s: Running) -> list[str]:
        s.tokens()
        return pinned(s)
    up, st = both(base_args() + flags, tmp_path, probe)
    assert set(up) == set(st) == cpus and len(st) == 2, (up, st)


@pytest.mark.parametrize("batch", [["-Cb", "0x2", "--cpu-strict-batch", "1"], ["-Crb", "1-1"]], ids=["mask", "range"])
def test_batch_masks_pin_prompt_batches_and_the_single_token_masks_generation(tmp_path, batch):
    def probe(s: Running) -> tuple[list[str], list[str]]:
        s.tokens(n=0)
        prompt = pinned(s)
        s.tokens(n=4)
        return prompt, pinned(s)
    args = base_args() + ["-tb", "2", "-C", "0x1", "--poll-batch", "0", *batch]
    up, st = both(args, tmp_path, probe)
    assert st == (["1", "1"], ["0", "0"]), st
    # upstream's queue thread keeps the batch mask it inherited
    assert set(up[0]) == {"1"} and up[1].count("0") == 2, up


# ---- control vectors -------------------------------------------------------------------------

def write_control_vector(path: Path, layers, seed: int = 7, scale: float = 2.0, n_embd: int = N_EMBD, name: str = "direction.{}") -> Path:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_uint32("controlvector.layer_count", len(layers))
    for il in layers:
        w.add_tensor(name.format(il), (rng.standard_normal(n_embd) * scale).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_control_vectors_steer_generation_as_upstream_does(tmp_path):
    cv = write_control_vector(tmp_path / "cv.gguf", range(1, N_LAYER))
    cv2 = write_control_vector(tmp_path / "cv2.gguf", range(1, N_LAYER), seed=8)
    with serve("strata", base_args(), tmp_path) as s:
        plain = s.tokens()
    runs = {}
    for label, flags in {
        "vector": ["--control-vector", str(cv)],
        "scaled": ["--control-vector-scaled", f"{cv}:0.5", "--control-vector-scaled", f"{cv2}:-1.5"],
        "layers": ["--control-vector", str(cv), "--control-vector-layer-range", "2", "3"],
    }.items():
        up, st = both(base_args() + flags, tmp_path, lambda s: s.tokens())
        assert up == st, label
        assert st != plain, f"{label}: the control vector changed nothing"
        runs[label] = st
    assert len({tuple(t) for t in runs.values()}) == 3, runs


@pytest.mark.parametrize("kind", ["missing", "layer-zero", "wrong-width"])
def test_a_bad_control_vector_is_logged_and_skipped_as_upstream_does(tmp_path, kind):
    path = tmp_path / f"{kind}.gguf"
    if kind == "layer-zero":
        write_control_vector(path, [0, 1])
    elif kind == "wrong-width":
        write_control_vector(path, [1, 2], n_embd=N_EMBD * 2)
    with serve("strata", base_args(), tmp_path) as s:
        plain = s.tokens()

    def probe(s: Running):
        return s.tokens(), cmn_lines(s.log(), "control vector", "direction tensor", "llama_adapter_cvec", "warming up")
    up, st = both(base_args() + ["-lv", "4", "--control-vector", str(path)], tmp_path, probe)
    assert st[0] == up[0] == plain
    assert st[1] == up[1] and st[1], (up[1], st[1])
    # common_init_from_params returns before the warm-up
    assert not any("warming up" in line for line in st[1])


# ---- warm-up ---------------------------------------------------------------------------------

WARMUP = "warming up the model with an empty run"


def test_warmup_runs_by_default_and_after_every_wake(tmp_path):
    def wakes(s: Running) -> list[int]:
        counts = [s.log().count(WARMUP)]
        for _ in range(2):
            while not s.get("/props")["is_sleeping"]:
                time.sleep(0.1)
            s.tokens(n=2)
            counts.append(s.log().count(WARMUP))
        return counts
    up, st = both(base_args() + ["-lv", "4", "--sleep-idle-seconds", "1"], tmp_path, wakes)
    assert up == st == [1, 2, 3]
    up, st = both(base_args() + ["-lv", "4", "--no-warmup"], tmp_path, lambda s: s.log().count(WARMUP))
    assert up == st == 0


# ---- context shift ---------------------------------------------------------------------------

def test_a_memory_that_cannot_shift_turns_the_context_shift_off_with_upstreams_warning(tmp_path):
    # a hybrid model (recurrent layers) cannot shift positions
    args = ["-m", str(MODELS / "tiny-qwen35moe-draft.gguf"), "-c", "1024", "-np", "1", "--context-shift"]
    up, st = both(args, tmp_path, lambda s: cmn_lines(s.log(), "shift"))
    assert up == st == ["cmn  common_init_: KV cache shifting is not supported for this context, disabling KV cache shifting"], (up, st)


# ---- reranking vocabulary checks -------------------------------------------------------------

def without_vocabulary(w, fields) -> None:
    """No tokenizer, so no BOS, EOS or SEP token: the reranking checks fail."""
    n_vocab = len(fields["tokenizer.ggml.tokens"][0])
    for name in [k for k in fields if k.startswith("tokenizer.") and k != "tokenizer.ggml.token_type_count"]:
        del fields[name]
    w.add_tokenizer_model("none")
    w.add_vocab_size(n_vocab)


@pytest.mark.parametrize("vocab", ["bert", "none"])
def test_rerank_vocab_checks_warn_as_upstream_does(tmp_path, vocab):
    model = RERANK if vocab == "bert" else copy_gguf(RERANK, tmp_path / "no-vocab.gguf", without_vocabulary)
    args = ["-m", str(model), "--rerank", "-c", "512", "-np", "1", "-lv", "4"]
    up, st = both(args, tmp_path, lambda s: cmn_lines(s.log(), "vocab does not", WARMUP))
    assert up == st, (up, st)
    warnings = {
        "bert": ["vocab does not have an EOS token, using SEP token as fallback"],
        "none": ["vocab does not have a  BOS token, reranking will not work",
                 "vocab does not have an EOS token, SEP token, or rerank prompt. Reranking will not work"],
    }[vocab]
    assert [l.split(": ", 1)[1] for l in st if "vocab" in l] == warnings, st
    # the failed check returns before the warm-up, as common_init_from_params does
    assert any(WARMUP in l for l in st) == (vocab == "bert")


# ---- fit -------------------------------------------------------------------------------------

FIT = ("fitting params", "(for bugs during this step", "common_params_fit_impl:", "common_fit_params:", "common_memory_breakdown_print:")


def fit_lines(log: str) -> list[str]:
    return [l for l in cmn_lines(log, *FIT) if " took " not in l]


def test_fit_on_the_cpu_sizes_the_context_as_upstream_does(tmp_path):
    def probe(s: Running):
        return s.get("/props")["default_generation_settings"]["n_ctx"], fit_lines(s.log())
    # two slots without a unified KV cache and no -c: fit gives each slot the training context
    args = ["-m", str(LLAMA), "-np", "2", "-t", "2", "-lv", "4"]
    up, st = both(args, tmp_path, probe)
    assert up == st and st[0] == 4096 and st[1], (up, st)
    up, st = both(args + ["-fit", "off"], tmp_path, probe)
    assert up == st and st == (2048, []), (up, st)
    up, st = both(args + ["-fitc", "1024", "-fitt", "2048"], tmp_path, probe)
    assert up == st and st[0] == 4096 and any(">= 2048 MiB" in l for l in st[1]), (up, st)


# ---- sampling defaults and --ignore-eos ------------------------------------------------------

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "xtc_probability", "xtc_threshold", "repeat_last_n",
                 "repeat_penalty", "mirostat", "mirostat_tau", "mirostat_eta", "samplers", "ignore_eos")


def with_sampling_defaults(w, fields) -> None:
    w.add_sampling_sequence("penalties;top_k;top_p;min_p;temperature")
    w.add_sampling_top_k(13)
    w.add_sampling_top_p(0.75)
    w.add_sampling_min_p(0.125)
    w.add_sampling_temp(0.375)
    w.add_sampling_penalty_last_n(32)
    w.add_sampling_penalty_repeat(1.25)
    w.add_sampling_xtc_probability(0.25)
    w.add_sampling_xtc_threshold(0.3)


def settings(s: Running) -> dict:
    params = s.get("/props")["default_generation_settings"]["params"]
    return {k: params[k] for k in SAMPLING_KEYS}


def test_the_models_sampling_defaults_apply_under_the_command_lines(tmp_path):
    model = copy_gguf(LLAMA, tmp_path / "sampling.gguf", with_sampling_defaults)
    up, st = both(["-m", str(model), "-c", "1024", "-np", "1"], tmp_path, settings)
    assert up == st
    assert st["top_k"] == 13 and st["temperature"] == 0.375 and st["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    up, st = both(["-m", str(model), "-c", "1024", "-np", "1", "--top-k", "3", "--temp", "0.5", "--samplers", "top_k;temperature"], tmp_path, settings)
    assert up == st
    assert st["top_k"] == 3 and st["temperature"] == 0.5 and st["top_p"] == 0.75 and st["samplers"] == ["top_k", "temperature"]


def test_ignore_eos_bans_the_end_of_generation_as_upstream_does(tmp_path):
    # a bias that makes </s> (token 2) the greedy choice: without --ignore-eos generation stops at once
    args = base_args() + ["-l", "2+100"]
    up, st = both(args, tmp_path, lambda s: (settings(s), s.tokens()))
    assert up == st and st[1] == [2], st
    up, st = both(args + ["--ignore-eos"], tmp_path, lambda s: (settings(s), s.tokens()))
    assert up == st and len(st[1]) == 16 and 2 not in st[1], st


def test_a_requests_ignore_eos_keeps_the_command_lines_logit_biases(tmp_path):
    # the command line's bias makes token 13 the greedy choice; a request that only sets
    # ignore_eos runs with it, and with its own logit_bias without it
    def probe(s: Running):
        return (s.tokens(ignore_eos=True), s.tokens(ignore_eos=True, logit_bias=[[14, 100]]),
                s.tokens(ignore_eos=False))
    up, st = both(base_args() + ["-l", "13+100"], tmp_path, probe)
    assert up == st
    assert set(st[0]) == {13} and set(st[1]) == {14} and set(st[2]) == {13}, st


# ---- speculative decoding that fails to start ------------------------------------------------

@pytest.mark.parametrize("flags, why", [
    (["--spec-type", "draft-simple"], "draft-simple requires a draft context"),
    (["-md", str(MODELS / "tiny-qwen3moe.gguf"), "--spec-type", "draft-simple"], "draft model vocab type must match target model to use speculation"),
], ids=["no-draft-model", "other-vocabulary"])
def test_a_drafter_that_fails_to_start_leaves_the_server_without_one(tmp_path, flags, why):
    def probe(s: Running):
        return s.tokens(), cmn_lines(s.log(), "failed to initialize speculative")
    up, st = both(base_args() + flags, tmp_path, probe)
    with serve("strata", base_args(), tmp_path) as s:
        plain = s.tokens()
    assert up == st and st[0] == plain
    assert st[1] == [f"srv    load_model: failed to initialize speculative decoding context: {why}"]
