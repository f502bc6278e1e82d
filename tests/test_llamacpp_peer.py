"""The llama.cpp peer (`bench.py --compare llamacpp`): parsing llama-batched-bench's table, the
command line, where llama.cpp and the GGUF files are looked for and cached. The end-to-end test
needs a llama.cpp build and source (found as bench.py finds them) and skips without one."""
from __future__ import annotations

import importlib.util
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from nanoserve.bench.cli import main, parse_args
from nanoserve.bench.peers.llamacpp import (BatchedBenchRow, LlamaCppPeer, batched_bench_command,
                                            parse_batched_bench, row_result, workload_lengths)
from nanoserve.bench.peers.llamacpp_setup import (BINARIES, QUANTIZATIONS, binaries_in, checkpoint_fingerprint,
                                                  conversion_steps, ensure_gguf, find_binaries, find_source,
                                                  gguf_dir, gguf_path, llamacpp_root, resolve_source)
from nanoserve.bench.peers import PeerSettings, PeerUnavailable
from nanoserve.bench.workloads import Request, WorkloadSpec, make_requests

DATA = Path(__file__).parent / "data" / "llamacpp"
# tests/data/llamacpp/batched_bench_qwen3_0.6b_q8_0.txt: the complete output (stdout and stderr) of
# `llama-batched-bench -m model-Q8_0.gguf -c 8192 -b 2048 -ub 512 -npp 50 -ntg 46 -npl 16 -t 2 -fa on`
# (llama.cpp of llama-cpp-python 0.3.36, built as llamacpp_setup.py builds it) on the Q8_0 conversion
# of the random-weight Qwen3-0.6B checkpoint, the default workload's count and mean lengths; taken
# at nice 19 on a busy 2-core AVX2 machine, so its timings are slow and only its format matters.
EXPECTED_ROW = BatchedBenchRow(pp=50, tg=46, pl=16, n_kv=1536, t_pp=38.072, s_pp=21.01, t_tg=54.933, s_tg=13.40,
                               t=93.005, s=16.52)
TINY_WORKLOAD = ["--num-seqs", "3", "--input-len", "5", "20", "--output-len", "2", "6", "--dtype", "float32"]


# ---- batched-bench's output ------------------------------------------------------------------

def test_parse_batched_bench_reads_the_captured_table_of_a_real_run():
    text = (DATA / "batched_bench_qwen3_0.6b_q8_0.txt").read_text()
    rows = parse_batched_bench(text)
    # The sample's one row, as llama-batched-bench printed it (its log lines around it are ignored).
    assert rows == [EXPECTED_ROW]


def test_a_row_on_nanoserves_basis():
    res = row_result("llama.cpp Q8_0", EXPECTED_ROW)
    n, p, g = EXPECTED_ROW.pl, EXPECTED_ROW.pp, EXPECTED_ROW.tg
    assert (res.num_requests, res.prompt_tokens, res.output_tokens) == (n, n * p, n * g)
    # Seconds from the speed columns: n * p / S_PP + n * g / S_TG.
    assert res.wall_s == pytest.approx(n * p / 21.01 + n * g / 13.40)
    assert res.output_tok_s == pytest.approx(n * g / res.wall_s)
    assert (res.prefill_tok_s, res.decode_tok_s) == (21.01, 13.40)
    # They agree with its (rounded) time columns: output tok/s = N x G / (T_PP + T_TG).
    assert res.output_tok_s == pytest.approx(n * g / (EXPECTED_ROW.t_pp + EXPECTED_ROW.t_tg), rel=1e-3)
    assert res.decode_s == pytest.approx(EXPECTED_ROW.t_tg, rel=1e-3)


def test_parse_ignores_headers_and_log_lines():
    text = ("main: n_kv_max = 8192, n_batch = 2048\n"
            "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
            "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
            "|     8 |      4 |    2 |     24 |    0.010 |  1600.00 |    0.020 |   400.00 |    0.030 |   800.00 |\n"
            "llama_perf_context_print:        load time =      12.34 ms\n")
    assert parse_batched_bench(text) == [BatchedBenchRow(8, 4, 2, 24, 0.01, 1600.0, 0.02, 400.0, 0.03, 800.0)]
    assert parse_batched_bench("error: unable to load model\n") == []


# ---- the command line ------------------------------------------------------------------------

def test_workload_lengths_are_the_count_and_rounded_means():
    requests = [Request([1] * 10, 3), Request([1] * 13, 4), Request([1] * 20, 8)]
    assert workload_lengths(requests) == (3, 14, 5)  # means 14.33 and 5.0
    with pytest.raises(ValueError, match="at least one request"):
        workload_lengths([])


def test_batched_bench_command_follows_peers_md():
    # PEERS.md's command, plus a trailing single-sequence row (-npl N,1) that keeps the process alive
    # while llama.cpp's log thread prints the measured row.
    cmd = batched_bench_command("/b/llama-batched-bench", "/m/model-Q8_0.gguf", n=16, p=146, g=175, threads=2)
    assert cmd == ["/b/llama-batched-bench", "-m", "/m/model-Q8_0.gguf", "-c", "8192", "-b", "2048", "-ub", "512",
                   "-npp", "146", "-ntg", "175", "-npl", "16,1", "-t", "2", "-fa", "on"]
    # Every sequence must fit its share of the context, else batched-bench silently skips the row.
    long = batched_bench_command("bb", "m.gguf", n=3, p=4000, g=16, threads=2)
    assert long[long.index("-c") + 1] == str(3 * 4016)
    # A retry pads with more trailing rows: under load the log thread needs longer to get a core.
    padded = batched_bench_command("bb", "m.gguf", n=3, p=4, g=2, threads=2, trailing=8)
    assert padded[padded.index("-npl") + 1] == "3," + ",".join(["1"] * 8)
    with pytest.raises(ValueError, match="trailing"):
        batched_bench_command("bb", "m.gguf", n=3, p=4, g=2, threads=2, trailing=0)


def test_a_lost_row_is_retried_with_more_trailing_rows(tmp_path):
    # Stands in for batched-bench under load: the measured row reaches the log only when at least
    # 8 trailing rows follow it; otherwise the process exits cleanly without it.
    fake = tmp_path / "llama-batched-bench"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-npl" ]; do shift; done\n'
                    'rows=$(echo "$2" | tr "," "\\n" | wc -l)\n'
                    'if [ "$rows" -ge 9 ]; then echo "|    12 |      5 |    3 |     51 |    0.010 |  3600.00 |'
                    '    0.020 |   750.00 |    0.030 |  1700.00 |"; fi\n')
    fake.chmod(0o755)
    peer = LlamaCppPeer("Q8_0", PeerSettings(model="m", dtype="bfloat16", device="cpu", threads=2),
                        [Request([1] * 12, 5)] * 3, {"llama-batched-bench": str(fake)}, source="/src")
    peer.gguf = "m.gguf"
    (run,) = peer.run()
    assert (run.num_requests, run.output_tokens) == (3, 15)
    fake.write_text("#!/bin/sh\necho no table\n")  # never prints the row: a clear error, not a hang
    with pytest.raises(PeerUnavailable, match="no row for 3 x"):
        peer.run()


def test_cli_llamacpp_flags(tmp_path):
    args = parse_args(["--compare", "llamacpp", "--llamacpp-quants", "Q8_0, bf16", "--llamacpp-dir", str(tmp_path)])
    assert (args.compare, args.llamacpp_quants, args.llamacpp_dir) == (["llamacpp"], ["Q8_0", "bf16"], str(tmp_path))
    assert parse_args([]).llamacpp_quants == list(QUANTIZATIONS)
    for bad in ("Q4_0", ","):
        with pytest.raises(SystemExit):
            parse_args(["--llamacpp-quants", bad])


# ---- finding llama.cpp -----------------------------------------------------------------------

def _fake_binaries(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        path = directory / name
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_find_binaries_in_a_build_dir_or_says_where_to_build(tmp_path):
    build = tmp_path / "build"
    _fake_binaries(build / "bin")
    found, directory = find_binaries(str(build))
    assert found == {name: str(build / "bin" / name) for name in BINARIES} and directory == str(build)
    empty = tmp_path / "empty"
    assert find_binaries(str(empty)) == (None, str(empty))
    (build / "bin" / BINARIES[1]).chmod(0o644)  # not executable: not a build
    assert binaries_in(str(build)) is None


def _fake_llamacpp_python_source(root: Path) -> Path:
    llama = root / "vendor" / "llama.cpp"
    llama.mkdir(parents=True)
    (llama / "convert_hf_to_gguf.py").write_text("")
    return llama


def test_source_from_a_dir_a_tarball_or_the_builds_cmake_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NANOSERVE_LLAMACPP_SOURCE", raising=False)
    sdist = tmp_path / "llama_cpp_python-0.3.36"
    llama = _fake_llamacpp_python_source(sdist)
    assert llamacpp_root(str(sdist)) == str(llama) == llamacpp_root(str(llama))
    assert resolve_source(str(sdist)) == str(llama)
    tarball = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(sdist, arcname=sdist.name)
    extracted = resolve_source(str(tarball))
    assert extracted.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(extracted,
                                                                                         "convert_hf_to_gguf.py"))
    build = tmp_path / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text(f"FOO:BOOL=ON\nCMAKE_HOME_DIRECTORY:INTERNAL={llama}\n")
    assert find_source(None, str(build)) == str(llama)
    with pytest.raises(PeerUnavailable, match="not a llama.cpp source"):
        resolve_source(str(tmp_path / "build"))


# ---- the GGUF cache beside the checkpoint ----------------------------------------------------

def _fake_checkpoint(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "qwen3"}')
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


def test_gguf_cache_paths_and_what_still_needs_making(tmp_path):
    model = _fake_checkpoint(tmp_path / "ckpt")
    assert gguf_dir(str(model)) == str(tmp_path / "ckpt-gguf")
    assert gguf_dir(str(model) + "/") == str(tmp_path / "ckpt-gguf")
    bf16, q8 = gguf_path(str(model), "bf16"), gguf_path(str(model), "Q8_0")
    assert q8 == str(tmp_path / "ckpt-gguf" / "model-Q8_0.gguf")
    # Nothing cached: convert to bf16, then quantize that.
    steps = conversion_steps(str(model), "Q8_0", "/src", "/bin/llama-quantize")
    assert [out for out, _ in steps] == [bf16, q8]
    assert steps[0][1][-4:] == ["--outtype", "bf16", "--outfile", bf16 + ".partial"]
    assert steps[1][1] == ["/bin/llama-quantize", bf16, q8 + ".partial", "Q8_0"]
    assert [out for out, _ in conversion_steps(str(model), "bf16", "/src", "q")] == [bf16]
    with pytest.raises(ValueError, match="Q4_K_M"):
        conversion_steps(str(model), "q3", "/src", "q")


def test_ensure_gguf_reuses_a_current_cache_and_remakes_a_stale_one(tmp_path):
    model = _fake_checkpoint(tmp_path / "ckpt")
    quantize = tmp_path / "llama-quantize"  # stands in for llama-quantize: copies its input, tags the type
    quantize.write_text('#!/bin/sh\n{ cat "$1"; echo "$3"; } > "$2"\n')
    quantize.chmod(0o755)
    out_dir = Path(gguf_dir(str(model)))
    out_dir.mkdir()
    (out_dir / "model-bf16.gguf").write_text("bf16\n")
    (out_dir / "source.json").write_text(json.dumps(checkpoint_fingerprint(str(model))))
    # bf16 is cached and current: only the quantization runs, into place.
    q8 = ensure_gguf(str(model), "Q8_0", "/no/source", str(quantize))
    assert Path(q8).read_text() == "bf16\nQ8_0\n" and not os.path.exists(q8 + ".partial")
    assert conversion_steps(str(model), "Q8_0", "/no/source", str(quantize)) == []
    assert ensure_gguf(str(model), "Q8_0", "/no/source", "/no/quantize") == q8  # nothing runs
    # The checkpoint is rebuilt: every cached file is stale.
    (model / "model.safetensors").write_bytes(b"\1" * 65)
    assert [out for out, _ in conversion_steps(str(model), "Q8_0", "/no/source", "q")] == [
        gguf_path(str(model), "bf16"), q8]


# ---- through bench.py ------------------------------------------------------------------------

def test_llamacpp_peer_without_llamacpp_is_skipped_with_a_clear_message(tiny_model, tmp_path, capsys):
    report = main(["--model", tiny_model, *TINY_WORKLOAD, "--no-roofline", "--compare", "llamacpp",
                   "--llamacpp-dir", str(tmp_path / "no-build"), "--llamacpp-source", str(tmp_path / "no-source")])
    assert "[llamacpp] skipped: --llamacpp-source " in capsys.readouterr().out
    assert "llama-cpp-python" in report["peers_skipped"]["llamacpp"]
    assert report["nanoserve"][0]["counts_ok"]


def _llamacpp_available() -> bool:
    found, directory = find_binaries(None)
    if found is None:
        return False
    try:
        find_source(None, directory)
    except PeerUnavailable:
        return False
    return importlib.util.find_spec("sentencepiece") is not None  # the converter imports it


@pytest.mark.skipif(not _llamacpp_available(), reason="no llama.cpp build and source (see llamacpp_setup.py)")
def test_bench_runs_llamacpp_on_the_workloads_mean_lengths(tiny_model, capsys):
    report = main(["--model", tiny_model, *TINY_WORKLOAD, "--no-roofline", "--compare", "llamacpp",
                   "--llamacpp-quants", "bf16,Q8_0"])
    assert "peers_skipped" not in report and "peer_errors" not in report
    requests = make_requests_for(tiny_model)
    n, p, g = workload_lengths(requests)
    for quant in ("bf16", "Q8_0"):
        assert os.path.isfile(gguf_path(tiny_model, quant))
        (run,) = report["peers"][f"llama.cpp {quant}"]
        assert (run["num_requests"], run["prompt_tokens"], run["output_tokens"]) == (n, n * p, n * g)
        assert run["output_tok_s"] == pytest.approx(n * g / run["wall_s"])
        assert run["prefill_tok_s"] > 0 and run["decode_tok_s"] > 0
    assert [row["engine"] for row in report["table"]] == ["nanoserve", "llama.cpp bf16", "llama.cpp Q8_0"]
    assert "| llama.cpp Q8_0 |" in capsys.readouterr().out


def make_requests_for(model: str) -> list[Request]:
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return make_requests(WorkloadSpec("random", 3, (5, 20), (2, 6)), vocab)
