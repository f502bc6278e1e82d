"""Nobody else gets in: a tensor-parallel engine listens on loopback only and rendezvouses through a
private file; checkpoints load from safetensors only and no code from a checkpoint ever runs."""
import ipaddress
import json
import os
import shutil
import stat
import tempfile

import pytest
from helpers import make_llm, random_prompts

from nanoserve import SamplingParams


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp(6) writes each 32-bit word of the address in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with open(table) as f:
            next(f)  # header
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    host, port = local.split(":")
                    found.append((str(_address(host)), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class SocketProbe:
    """A tqdm-like progress bar for generate(use_tqdm=...): at each step it records what the
    engine's processes listen on, so the check runs in the middle of a generate call."""

    postfix = ""

    def __init__(self, pids, before):
        self.pids, self.before, self.seen = pids, before, set()

    def __call__(self, **kwargs):
        return self

    def update(self, n=1):
        for pid in self.pids:
            self.seen.update((pid, a) for a in listening_sockets(pid) if (pid, a) not in self.before)

    def set_postfix(self, *args, **kwargs):
        self.update()

    def set_postfix_str(self, *args, **kwargs):
        pass

    def close(self):
        pass


def test_listening_sockets_parser_sees_a_socket():
    """The parser can fail: a socket bound to all interfaces is reported as such."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ("0.0.0.0", port) in listening_sockets(os.getpid())
        assert not is_loopback("0.0.0.0") and is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1")


def test_tensor_parallel_engine_listens_on_loopback_only(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the rendezvous directory goes
    before = {(os.getpid(), a) for a in listening_sockets(os.getpid())}
    llm = make_llm(tiny_model, device="cpu", tensor_parallel_size=2, num_kvcache_blocks=64, max_model_len=128)
    try:
        (worker,) = llm.engine.model_runner.worker_pids
        probe = SocketProbe([os.getpid(), worker], before)
        llm.generate(random_prompts(4, 3, 20, seed=1), SamplingParams(max_tokens=4), use_tqdm=probe)
        assert any(pid == worker for pid, _ in probe.seen), "found no socket of the worker: the probe is broken"
        exposed = [(pid, address) for pid, address in probe.seen if not is_loopback(address[0])]
        assert not exposed, f"listening beyond loopback: {exposed}"
        # The rendezvous is a file in a directory only this user can enter.
        (rendezvous,) = [p for p in tmp_path.iterdir() if p.name.startswith("nanoserve-tp-")]
        assert stat.S_IMODE(rendezvous.stat().st_mode) == 0o700
    finally:
        llm.close()
    assert not list(tmp_path.iterdir()), "the rendezvous directory outlived the engine"


def test_only_pickle_weights_is_a_clear_error(tiny_model, tmp_path):
    path = shutil.copytree(tiny_model, tmp_path / "m")
    os.rename(path / "model.safetensors", path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights; it holds pickle weights \(pytorch_model\.bin\), "
                                         r"which nanoserve never loads"):
        make_llm(str(path))


def test_code_in_a_checkpoint_never_runs(tiny_model, tmp_path):
    """auto_map entries pointing at Python files beside the weights are ignored. (LLM's
    trust_remote_code=True never reaches the engine: test_vllm_compat checks it is dropped.)"""
    path = shutil.copytree(tiny_model, tmp_path / "m")
    marker = tmp_path / "code-ran"
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (path / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write({module!r})\n")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (path / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))

    llm = make_llm(str(path), num_kvcache_blocks=32, max_model_len=64)
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert not marker.exists(), f"checkpoint code ran: {marker.read_text()}"
    assert "evil" not in type(llm.get_tokenizer()).__module__.lower()
