"""The README, the Dockerfile and the requirements agree with each other and with the code.

Fast, CPU only, no network: every check reads files of the repository. Each check is a function
of text, and test_the_checks_catch_mistakes feeds them broken text, so none of them passes vacuously.
"""
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

README = ROOT / "README.md"
DOCKERFILE = ROOT / "Dockerfile"
FIRST_SCREEN = 60  # lines
TEST_COMMAND = 'pip install -r requirements.txt && python -m pytest -q tests -m "not slow"'  # the quick set
SLOW_COMMAND = "python -m pytest -q tests -m slow"  # the end-to-end set, the README's second command
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


# ---- Dockerfile

def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    out, pending = [], ""
    for line in dockerfile.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def base_cuda(dockerfile: str) -> tuple[int, int]:
    """(major, minor) of the nvidia/cuda base image: exactly one FROM, and it is nvidia/cuda."""
    froms = [args for word, args in instructions(dockerfile) if word == "FROM"]
    assert len(froms) == 1, f"expected one FROM, found {froms}"
    m = re.fullmatch(r"(?:docker\.io/|nvcr\.io/)?nvidia/cuda:(\d+)\.(\d+)(?:\.\d+)?-\S+", froms[0].split()[0])
    assert m, f"the base image is not an nvidia/cuda:X.Y.Z-... image: {froms[0]}"
    return int(m[1]), int(m[2])


def pip_installs(dockerfile: str) -> list[list[str]]:
    """The argument lists of every `pip install` in the RUN instructions."""
    cmds = []
    for word, args in instructions(dockerfile):
        if word != "RUN":
            continue
        # the words (no shell expansion), split into commands at && ; || | and `then` outside quotes (a quoted
        # `python -c "import tiktoken; ..."` is one word)
        lexer = shlex.shlex(args.replace("$", "_"), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        parts = [[]]
        for token in lexer:
            if token in ("&&", ";", "||", "|", "then"):
                parts.append([])
            else:
                parts[-1].append(token)
        for tokens in parts:
            for i in range(len(tokens) - 1):
                if tokens[i].endswith("pip") and tokens[i + 1] == "install":
                    cmds.append(tokens[i + 2:])
                    break
    return cmds


def torch_install(dockerfile: str) -> tuple[str, str]:
    """(version, build tag such as cu130) of the one `pip install torch==X --index-url .../whl/TAG`."""
    found = []
    for args in pip_installs(dockerfile):
        pins = [a for a in args if re.fullmatch(r"torch(==|>=|<=|~=|>|<|!=)?.*", a) and not a.startswith("torch-")]
        if not pins:
            continue
        assert len(pins) == 1 and pins[0].startswith("torch=="), f"torch must be pinned with ==: {args}"
        index = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--index-url"]
        index += [a.split("=", 1)[1] for a in args if a.startswith("--index-url=")]
        assert len(index) == 1, f"torch must come from one PyTorch index (--index-url): {args}"
        m = re.fullmatch(r"https://download\.pytorch\.org/whl/(cu\d+|cpu)/?", index[0])
        assert m, f"not a download.pytorch.org build index: {index[0]}"
        found.append((pins[0][len("torch=="):], m[1]))
    assert len(found) == 1, f"expected exactly one pip install of torch, found {found}"
    return found[0]


def cuda_tag(major: int, minor: int) -> str:
    """PyTorch's name for a CUDA build: 13.0 -> cu130, 12.8 -> cu128."""
    return f"cu{major}{minor}"


def check_torch_matches_base(dockerfile: str) -> None:
    major, minor = base_cuda(dockerfile)
    version, tag = torch_install(dockerfile)
    assert tag == cuda_tag(major, minor), (
        f"the base image is CUDA {major}.{minor} but torch=={version} comes from the {tag} build")


def check_torch_kept(dockerfile: str) -> None:
    """Every later pip install either has --no-deps or a -c constraint file that pins torch to
    the installed version (else a dependency could replace the torch build the base image matches)."""
    version, _ = torch_install(dockerfile)
    pinned_files = set(re.findall(r'echo\s+"?torch==' + re.escape(version) + r'"?\s*>\s*(\S+)', dockerfile))
    for args in pip_installs(dockerfile):
        if any(a.startswith("torch==") for a in args) or "--no-deps" in args:
            continue
        constraints = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-c", "--constraint")}
        assert constraints & pinned_files, (
            f"`pip install {' '.join(args)}` may replace torch=={version}: add --no-deps or -c with a file "
            f"holding torch=={version} (files written so: {sorted(pinned_files)})")


def env_vars(dockerfile: str) -> dict[str, str]:
    env = {}
    for word, args in instructions(dockerfile):
        if word == "ENV":
            for token in shlex.split(args):
                key, eq, value = token.partition("=")
                if eq:
                    env[key] = value
    return env


def volumes(dockerfile: str) -> set[str]:
    out = set()
    for word, args in instructions(dockerfile):
        if word == "VOLUME":
            out |= set(json.loads(args)) if args.startswith("[") else set(args.split())
    return {v.rstrip("/") for v in out}


def workdir(dockerfile: str) -> str:
    dirs = [args for word, args in instructions(dockerfile) if word == "WORKDIR"]
    assert dirs, "no WORKDIR"
    return dirs[-1].rstrip("/")


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + "/")


def check_volumes(dockerfile: str, checkpoint_dir: str, log_dir: str) -> None:
    """Data, checkpoints, logs and the compile caches each lie on a volume."""
    wd, vols = workdir(dockerfile), volumes(dockerfile)
    needed = {"data": f"{wd}/data", "checkpoints": f"{wd}/{checkpoint_dir}", "logs": f"{wd}/{log_dir}"}
    env = env_vars(dockerfile)
    assert "TORCHINDUCTOR_CACHE_DIR" in env, "TORCHINDUCTOR_CACHE_DIR is not set: the compile cache stays in the container"
    needed["compile cache"] = env["TORCHINDUCTOR_CACHE_DIR"]
    if "TRITON_CACHE_DIR" in env:
        needed["Triton cache"] = env["TRITON_CACHE_DIR"]
    for what, path in needed.items():
        assert any(under(path, v) for v in vols), f"{what} ({path}) is on none of the volumes {sorted(vols)}"


def check_tokenizer_cache(dockerfile: str) -> None:
    """tiktoken's GPT-2 files (the record preset loads them at start) lie on a volume, fetched at build time
    before VOLUME (after it a build step's writes there are discarded): an offline node starts, no run downloads."""
    env, vols = env_vars(dockerfile), volumes(dockerfile)
    assert "TIKTOKEN_CACHE_DIR" in env, "TIKTOKEN_CACHE_DIR is not set: every --rm run downloads the GPT-2 tokenizer"
    assert any(under(env["TIKTOKEN_CACHE_DIR"], v) for v in vols), \
        f"the tokenizer cache ({env['TIKTOKEN_CACHE_DIR']}) is on none of the volumes {sorted(vols)}"
    steps = instructions(dockerfile)
    fill = [i for i, (word, args) in enumerate(steps) if word == "RUN" and "get_encoding('gpt2')" in args]
    volume = [i for i, (word, _) in enumerate(steps) if word == "VOLUME"]
    assert fill and volume and fill[0] < volume[0], "the GPT-2 tokenizer files are not fetched at build time before VOLUME"


# ---- README

def code_lines(markdown: str) -> list[str]:
    """The lines of indented or fenced code blocks, continuation lines joined."""
    out, fenced, pending = [], False, ""
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            text = line.strip()
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            out.append(pending + text)
            pending = ""
    return out


def commands(markdown: str) -> list[str]:
    """Code lines without their trailing `# comment`."""
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in code_lines(markdown)]


def check_first_screen(readme: str, ci_script: str) -> None:
    first = commands("\n".join(readme.splitlines()[:FIRST_SCREEN]))
    cpu = [c for c in first if CPU_INDEX in c and "-r requirements.txt" in c]
    assert cpu, f"no CPU set-up command (the CPU torch from {CPU_INDEX}, then requirements.txt) in the first screen"
    assert all(c.index(CPU_INDEX) < c.index("-r requirements.txt") for c in cpu), \
        "the CPU torch must be installed before requirements.txt"
    hopper = [c for c in first if re.search(r"-r requirements\.txt\b", c) and "-r requirements-hopper.txt" in c]
    assert hopper, "no Hopper set-up command (requirements.txt and requirements-hopper.txt) in the first screen"
    assert any(re.search(r"(^|&&\s*)\./run\.sh\b", c) for c in first), "no ./run.sh (the main job) in the first screen"
    assert TEST_COMMAND in first, f"the test command `{TEST_COMMAND}` is not in the first screen"
    assert SLOW_COMMAND in commands(readme), f"the end-to-end test command `{SLOW_COMMAND}` is not in the README"
    for command in (TEST_COMMAND, SLOW_COMMAND):
        assert command in [line.strip() for line in ci_script.splitlines()], \
            f".ci/run does not run the README's test command `{command}`"


def headings(markdown: str) -> list[str]:
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.append(m[1])
    return out


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    seen: dict[str, int] = {}
    out = set()
    for text in headings(markdown):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(md_file: Path, text: str | None = None) -> list[str]:
    """Relative links of a Markdown file whose file (or heading, for a .md target) does not exist."""
    text = md_file.read_text(encoding="utf-8") if text is None else text
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:  # a heading of this file
            if anchor not in anchors(text):
                bad.append(f"{target}: no such heading")
            continue
        dest = (md_file.parent / path).resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading #{anchor} in {path}")
    return bad


def section_references(text: str) -> list[str]:
    """Sections of the top-level README named in code and docs as `(README: Section)` or `(README, Section)`."""
    return re.findall(r"\((?:top-level )?README[:,] ([A-Z][\w' -]*)\)", text)


def docs_linked(index: str) -> list[str]:
    """The topic summaries bench/README.md links in bench/results/, as paths relative to bench/."""
    return re.findall(r"\]\((results/[\w-]+\.md)\)", index)


BENCH_INDEX = ROOT / "bench" / "README.md"
HISTORY = ROOT / "bench" / "results" / "public_line_history.md"  # the public line's chronology, out of the README
README_MAX_LINES = 250
STATUS_MAX_LINES = 15
# what a newcomer reads first, in this order; the details and measurements come after
NEWCOMER_ORDER = ["Set-up", "Main job", "Tests", "Layout", "Submitting a record", "Status"]


def sections(markdown: str) -> list[tuple[str, list[str]]]:
    """The level-2 sections: (title, the lines under it, blank lines at either end dropped)."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        if not fenced and (m := re.match(r"##\s+(.*?)\s*$", line)):
            out.append((m[1], []))
        elif out:
            out[-1][1].append(line)
    return [(title, "\n".join(body).strip("\n").splitlines()) for title, body in out]


def check_readme_shape(readme: str) -> None:
    """At most README_MAX_LINES lines; the newcomer's sections first and in order; a short status that
    never puts H100 and H200 figures side by side: no paragraph or list item of it names both kinds (it may
    hold a comparison measured on H200s and, in another item, the public records' published 8xH100 figures)."""
    n = len(readme.splitlines())
    assert n <= README_MAX_LINES, f"the README has {n} lines, over {README_MAX_LINES}: move detail to a page and link it"
    titles = [title for title, _ in sections(readme)]
    assert titles[:len(NEWCOMER_ORDER)] == NEWCOMER_ORDER, \
        f"the README should open with the sections {NEWCOMER_ORDER}, in that order; it has {titles}"
    status = dict(sections(readme))["Status"]
    assert len(status) <= STATUS_MAX_LINES, f"the README's status has {len(status)} lines, over {STATUS_MAX_LINES}"
    for item in re.split(r"\n\s*\n|\n(?=\s*[-*] )", "\n".join(status)):
        assert not ("H100" in item and "H200" in item), f"the README's status puts H100 and H200 figures together: {item}"


def check_status_numbers(status: str, page: str) -> None:
    """Every measured figure of the status (decimals such as 73.8 or -0.004) is one the page it summarizes has."""
    retyped = sorted({x for x in re.findall(r"\d+\.\d+", status) if x not in page})
    assert not retyped, f"figures of the README's status that the page it summarizes does not have: {retyped}"


BENCH_BUDGET = 1536 * 1024  # bytes on disk of the tracked bench/: 1.5 MiB, as `du` counts it


def disk_bytes(sizes: list[int], block: int = 4096) -> int:
    """What `du` reports for files of these sizes on a file system of `block`-byte blocks."""
    return sum(-(-size // block) * block for size in sizes)


def check_bench_budget(sizes: dict[str, int]) -> None:
    used = disk_bytes(list(sizes.values()))
    largest = ", ".join(f"{p} ({n // 1024} KiB)" for p, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:5])
    assert used <= BENCH_BUDGET, (
        f"tracked bench/ takes {used // 1024} KiB on disk, over {BENCH_BUDGET // 1024}: drop raw logs a summary already "
        f"holds (the page then names the commit that has them). Largest: {largest}")


def linked_pages(md_file: Path) -> list[Path]:
    """The Markdown files of this repository that md_file links to."""
    out = []
    for target in re.findall(r"\]\(([^)\s#]+\.md)(?:#[^)\s]*)?\)", md_file.read_text(encoding="utf-8")):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target) and (dest := (md_file.parent / target).resolve()).exists():
            out.append(dest)
    return sorted(set(out))


def topic_summaries() -> list[Path]:
    return sorted({BENCH_INDEX.parent / p for p in docs_linked(BENCH_INDEX.read_text(encoding="utf-8"))})


# ---- the tests

def test_dockerfile_base_image_cuda_matches_the_torch_build():
    check_torch_matches_base(DOCKERFILE.read_text())


def test_dockerfile_later_installs_keep_that_torch():
    check_torch_kept(DOCKERFILE.read_text())


def test_dockerfile_torch_is_the_measured_one_and_the_readme_installs_it():
    """The image's torch is a version and build the measurements used (bench/'s notes and results
    name them as `PyTorch X+cuNNN`), the README's Hopper command pins the same version, and the FlashAttention-4
    runtime of requirements-hopper.txt is for the same CUDA major version."""
    dockerfile = DOCKERFILE.read_text()
    version, tag = torch_install(dockerfile)
    notes = [*(ROOT / "bench").glob("*.md"), *(ROOT / "bench" / "results").glob("*.md")]
    measured = {m for f in notes for m in re.findall(r"PyTorch (\d+\.\d+\.\d+)\+(cu\d+)", f.read_text(encoding="utf-8"))}
    assert (version, tag) in measured, f"torch {version}+{tag} is not a build the measurements used: {sorted(measured)}"
    first = commands("\n".join(README.read_text().splitlines()[:FIRST_SCREEN]))
    hopper = [c for c in first if "-r requirements-hopper.txt" in c and "-r requirements.txt" in c]
    pins = {p for c in hopper for p in re.findall(r"\btorch==(\S+)", c)}
    assert pins == {version}, f"the README's Hopper set-up pins torch {pins or 'nowhere'}, the Dockerfile {version}"
    extras = re.findall(r"nvidia-cutlass-dsl\[cu(\d+)\]", (ROOT / "requirements-hopper.txt").read_text())
    assert extras == [str(base_cuda(dockerfile)[0])], \
        f"requirements-hopper.txt's nvidia-cutlass-dsl[cu..] extra {extras} is not for CUDA {base_cuda(dockerfile)[0]}"


def test_dockerfile_volumes_hold_data_checkpoints_logs_and_compile_cache():
    import train_gpt as tg
    args = tg.Hyperparameters()
    for field in ("checkpoint_dir", "log_dir"):
        assert not Path(getattr(args, field)).is_absolute(), f"{field} is absolute: the image's volumes assume it is not"
    check_volumes(DOCKERFILE.read_text(), args.checkpoint_dir.rstrip("/"), args.log_dir.rstrip("/"))


def test_dockerfile_keeps_the_gpt2_tokenizer_files_on_the_cache_volume_fetched_at_build():
    """Issue 61 item 7: the image had no TIKTOKEN_CACHE_DIR: each --rm run downloaded the GPT-2 files again and an
    offline node failed at start."""
    check_tokenizer_cache(DOCKERFILE.read_text())


def test_readme_docker_run_mounts_every_volume():
    """The README's `docker run --rm` example mounts each volume, so nothing a run writes goes with the container."""
    readme_cmds = commands(README.read_text())
    runs = [c for c in readme_cmds if c.startswith("docker run") and "--rm" in c and "--entrypoint" not in c]
    assert runs, "no `docker run --rm` example in the README"
    vols = volumes(DOCKERFILE.read_text())
    for run in runs:
        tokens = shlex.split(run.replace("$PWD", "PWD"))
        mounts = {tokens[i + 1].split(":")[1].rstrip("/") for i, t in enumerate(tokens[:-1]) if t in ("-v", "--volume")}
        assert vols <= mounts, f"`{run}` leaves {sorted(vols - mounts)} on anonymous volumes, deleted by --rm"


def test_readme_first_screen_has_the_setup_main_job_and_test_commands():
    check_first_screen(README.read_text(), (ROOT / ".ci" / "run").read_text())


def test_readme_main_job_gives_the_record_presets_trained_tokens():
    """The main job's comment names the tokens the record preset trains, in millions, as --plan counts them: a step
    count or batch change that leaves it stale fails here."""
    import train_gpt as tg
    said = re.search(r"the record trains on (\d+)M of those tokens", README.read_text(encoding="utf-8"))
    assert said, "README's main job no longer says how many of the downloaded tokens the record trains on"
    schedule = tg.Schedule(tg.parse_args([]))
    assert int(said[1]) == round(schedule.tokens_before(schedule.args.num_iterations) / 1e6)


def test_readme_bench_index_and_topic_summaries_links_resolve():
    """The README, bench/README.md (the index of tools and topics) and every topic summary it links in
    bench/results/: each relative link's file exists, and its heading where it names one."""
    topics = topic_summaries()
    assert topics, "bench/README.md links no topic summary in bench/results/"
    bad = [f"{f.relative_to(ROOT)}: {b}" for f in [README, BENCH_INDEX, *topics] for b in broken_links(f)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_and_every_page_it_links_resolve():
    """Each Markdown page the README links (the pages its detail moved to among them): its relative links resolve."""
    pages = linked_pages(README)
    assert HISTORY.resolve() in pages, "the README does not link bench/results/public_line_history.md"
    bad = [f"{f.relative_to(ROOT)}: {b}" for f in pages for b in broken_links(f)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_is_short_in_a_newcomers_order_with_a_status_from_the_history():
    readme = README.read_text(encoding="utf-8")
    check_readme_shape(readme)
    status = "\n".join(dict(sections(readme))["Status"])
    assert "public_line_history.md" in status, "the README's status does not link the page it summarizes"
    check_status_numbers(status, HISTORY.read_text(encoding="utf-8"))


def test_tracked_bench_stays_within_its_budget():
    import subprocess
    try:
        out = subprocess.run(["git", "ls-files", "-z", "bench"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    paths = [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
    assert paths, "git lists no file under bench/"
    check_bench_budget({p: (ROOT / p).stat().st_size for p in paths})


def test_sections_named_by_code_and_docs_exist_in_the_readme():
    files = [*ROOT.glob("*.py"), *ROOT.glob("*.sh"), *ROOT.glob("requirements*.txt"), DOCKERFILE,
             ROOT / ".dockerignore", *(ROOT / "data").glob("*.py"), *(ROOT / "records").glob("*.py"),
             *(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("*.sh"), *(ROOT / "bench").glob("*.md"),
             *[f for f in topic_summaries() if f.exists()]]
    readme_sections = set(headings(README.read_text()))
    missing = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        if f.suffix == ".md":
            text = " ".join(text.split())  # a reference may wrap in prose
        missing += [f"{f.relative_to(ROOT)}: README section '{s}'" for s in section_references(text)
                    if s not in readme_sections]
    assert not missing, "named but not in README.md:\n" + "\n".join(missing)


GOOD_DOCKERFILE = """\
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04
WORKDIR /workspace
RUN pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130 \\
 && echo "torch==2.11.0" > /opt/c.txt
RUN pip install -c /opt/c.txt -r requirements.txt
RUN if [ "$HOPPER" = 1 ]; then pip install --no-deps xformers==0.0.34; fi
ENV TORCHINDUCTOR_CACHE_DIR=/workspace/cache/inductor TIKTOKEN_CACHE_DIR=/workspace/cache/tiktoken
RUN python -c "import tiktoken; tiktoken.get_encoding('gpt2')"
VOLUME ["/workspace/data", "/workspace/checkpoints", "/workspace/logs", "/workspace/cache"]
"""
GOOD_README = "\n".join([
    "# x", "", f"    pip install torch --index-url {CPU_INDEX} && pip install -r requirements.txt",
    "    pip install torch==2.11.0 -r requirements.txt -r requirements-hopper.txt",
    "    python data/cached_fineweb10B.py 9 && ./run.sh", f"    {TEST_COMMAND}", "", f"    {SLOW_COMMAND}", ""])
GOOD_CI = f"#!/bin/sh\n{TEST_COMMAND}\n{SLOW_COMMAND}\n"


def test_the_checks_catch_mistakes(tmp_path):
    # the good inputs pass
    check_torch_matches_base(GOOD_DOCKERFILE)
    check_torch_kept(GOOD_DOCKERFILE)
    check_volumes(GOOD_DOCKERFILE, "checkpoints", "logs")
    check_tokenizer_cache(GOOD_DOCKERFILE)
    check_first_screen(GOOD_README, GOOD_CI)
    # the Dockerfile: a CUDA 12.6 base with a CUDA 13 torch
    with pytest.raises(AssertionError, match="CUDA 12.6"):
        check_torch_matches_base(GOOD_DOCKERFILE.replace("cuda:13.0.2", "cuda:12.6.3"))
    with pytest.raises(AssertionError, match="cu128"):
        check_torch_matches_base(GOOD_DOCKERFILE.replace("whl/cu130", "whl/cu128"))
    with pytest.raises(AssertionError, match="one PyTorch index"):  # PyPI's default build: CUDA not stated
        check_torch_matches_base(GOOD_DOCKERFILE.replace(" --index-url https://download.pytorch.org/whl/cu130", ""))
    with pytest.raises(AssertionError, match="pinned"):
        check_torch_matches_base(GOOD_DOCKERFILE.replace("torch==2.11.0 --index", "torch --index"))
    with pytest.raises(AssertionError, match="may replace torch"):
        check_torch_kept(GOOD_DOCKERFILE.replace("-c /opt/c.txt ", ""))
    with pytest.raises(AssertionError, match="may replace torch"):
        check_torch_kept(GOOD_DOCKERFILE.replace("--no-deps ", ""))
    with pytest.raises(AssertionError, match="checkpoints"):
        check_volumes(GOOD_DOCKERFILE.replace('"/workspace/checkpoints", ', ""), "checkpoints", "logs")
    with pytest.raises(AssertionError, match="compile cache"):
        check_volumes(GOOD_DOCKERFILE.replace("/workspace/cache/inductor", "/tmp/inductor"), "checkpoints", "logs")
    with pytest.raises(AssertionError, match="TORCHINDUCTOR_CACHE_DIR is not set"):
        check_volumes(GOOD_DOCKERFILE.replace("ENV TORCHINDUCTOR_CACHE_DIR", "ENV OTHER"), "checkpoints", "logs")
    with pytest.raises(AssertionError, match="TIKTOKEN_CACHE_DIR is not set"):
        check_tokenizer_cache(GOOD_DOCKERFILE.replace(" TIKTOKEN_CACHE_DIR=", " OTHER="))
    with pytest.raises(AssertionError, match="on none of the volumes"):
        check_tokenizer_cache(GOOD_DOCKERFILE.replace("/workspace/cache/tiktoken", "/root/.cache/tiktoken"))
    with pytest.raises(AssertionError, match="not fetched at build time before VOLUME"):  # after VOLUME: discarded
        check_tokenizer_cache(GOOD_DOCKERFILE.replace('RUN python -c "import tiktoken; tiktoken.get_encoding(\'gpt2\')"\n', "")
                              + 'RUN python -c "import tiktoken; tiktoken.get_encoding(\'gpt2\')"\n')
    # the README: requirements.txt alone, no CPU build, no Hopper attention
    with pytest.raises(AssertionError, match="CPU set-up"):
        check_first_screen(GOOD_README.replace(f"pip install torch --index-url {CPU_INDEX} && ", ""), GOOD_CI)
    with pytest.raises(AssertionError, match="before requirements.txt"):
        check_first_screen(GOOD_README.replace(
            f"pip install torch --index-url {CPU_INDEX} && pip install -r requirements.txt",
            f"pip install -r requirements.txt && pip install torch --index-url {CPU_INDEX}"), GOOD_CI)
    with pytest.raises(AssertionError, match="Hopper set-up"):
        check_first_screen(GOOD_README.replace(" -r requirements-hopper.txt", ""), GOOD_CI)
    with pytest.raises(AssertionError, match="test command"):
        check_first_screen(GOOD_README.replace("pytest -q tests", "pytest tests"), GOOD_CI)
    with pytest.raises(AssertionError, match="first screen"):
        check_first_screen("\n" * FIRST_SCREEN + GOOD_README, GOOD_CI)
    with pytest.raises(AssertionError, match=".ci/run"):
        check_first_screen(GOOD_README, "#!/bin/sh\npython -m pytest tests\n")
    with pytest.raises(AssertionError, match="-m slow"):  # CI must run the end-to-end set too
        check_first_screen(GOOD_README, f"#!/bin/sh\n{TEST_COMMAND}\n")
    with pytest.raises(AssertionError, match="end-to-end"):
        check_first_screen(GOOD_README.replace(f"    {SLOW_COMMAND}", ""), GOOD_CI)
    # the README's shape: length, order, status
    good = "\n".join(f"## {t}\n\ntext\n" for t in NEWCOMER_ORDER) + "\n## Docker\n\nmore\n"
    check_readme_shape(good)
    with pytest.raises(AssertionError, match="over 250"):
        check_readme_shape(good + "x\n" * README_MAX_LINES)
    with pytest.raises(AssertionError, match="in that order"):  # the status before the set-up
        check_readme_shape("## Status\n\nx\n" + good.replace("## Status\n\ntext\n", ""))
    with pytest.raises(AssertionError, match="in that order"):  # a long section moved up front
        check_readme_shape("## The public line\n\nx\n" + good)
    with pytest.raises(AssertionError, match="status has 16 lines"):
        check_readme_shape(good.replace("## Status\n\ntext\n", "## Status\n\n" + "x\n" * 16))
    with pytest.raises(AssertionError, match="H100 and H200"):
        check_readme_shape(good.replace("## Status\n\ntext\n", "## Status\n\n700.1 ms on one H100, 650.2 on one H200\n"))
    with pytest.raises(AssertionError, match="H100 and H200"):  # one list item, wrapped over two lines
        check_readme_shape(good.replace("## Status\n\ntext\n", "## Status\n\n- 700.1 ms on one H100,\n  650.2 on one H200\n"))
    check_readme_shape(good.replace("## Status\n\ntext\n", "## Status\n\n- 650.2 ms on one H200\n- 39.9 s on 8xH100\n"))
    check_status_numbers("73.8 s on 8xH100, -0.004 ± 0.007", "stood at 73.8 s ... (-0.004 ± 0.007, three seeds)")
    with pytest.raises(AssertionError, match="73.9"):
        check_status_numbers("73.9 s on 8xH100", "stood at 73.8 s")
    # bench/'s budget counts whole blocks, as du does
    assert disk_bytes([1, 4096, 4097]) == 4096 * 4
    check_bench_budget({"bench/a.md": 1000, "bench/results/b.txt": 900 * 1024})
    with pytest.raises(AssertionError, match="b.txt"):
        check_bench_budget({"bench/a.md": 1000, "bench/results/b.txt": 1600 * 1024})
    with pytest.raises(AssertionError, match="over 1536"):  # 400 small files at one block each
        check_bench_budget({f"bench/results/{i}.txt": 100 for i in range(400)})
    # links: a missing file, a missing heading, a good file and heading
    (tmp_path / "a.md").write_text("# Title\n\n## The public line\n")
    md = tmp_path / "README.md"
    assert broken_links(md, "[x](a.md) [y](a.md#the-public-line) [z](#here)\n\n## Here\n") == []
    assert broken_links(md, "[x](b.md)") == ["b.md: no such file"]
    assert len(broken_links(md, "[y](a.md#the-public-record)")) == 1
    md.write_text("[x](a.md) [y](a.md#the-public-line) [w](http://e.org/b.md) [v](gone.md)")
    assert linked_pages(md) == [(tmp_path / "a.md").resolve()]
    assert broken_links(md, "[z](#there)\n\n## Here\n") == ["#there: no such heading"]
    assert anchors("## Side by side with the public line's current code (issue 31)\n## `x.py`: A, B\n## A\n## A\n") == {
        "side-by-side-with-the-public-lines-current-code-issue-31", "xpy-a-b", "a", "a-1"}
    assert section_references('see (README: Hopper attention) and (README, Set-up)') == ["Hopper attention", "Set-up"]
