"""ANVIL2's hashed n-gram table (issue 64 item 2): the trigram channel, the row-sparse Adam with exact replay and its
exchange between ranks, the memory table and the start-up refusal."""
import dataclasses
from pathlib import Path

import pytest
import torch

import train_gpt as tg
from conftest import BOS, CASE_FOLDING_VOCAB, FAST, TINY
# ANVIL2's whole n-gram table: 84,602,880 rows, half bigram and half trigram, row-sparse (the record's default)
ANVIL2_TABLE = ["--bigram_rows", "42301440", "--trigram_rows", "42301440"]


def tiny_model(randomize=False, **overrides):
    args = tg.Hyperparameters(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args), tg.ModelKernels())
    if randomize:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p.float()).to(p.dtype))
    return model


def stream(T=200, starts=(0, 17, 18, 100, 199)):
    x = torch.randint(0, BOS, (T,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    x[list(starts)] = BOS
    return x, torch.tensor([*starts, T, T], dtype=torch.int32)


# -- 1. the trigram channel

def test_trigram_rows_are_anvil2s_hash_in_their_range_and_short_contexts_take_the_reserved_row():
    bigram_rows, rows, sign_rows = 1000, 500, 64
    starts = (0, 17, 18, 100, 199)  # a one-token document at 17
    x, cu = stream(starts=starts)
    row, sign = tg.trigram_indices(x, cu, bigram_rows, rows, sign_rows)
    t = x.tolist()
    short = set(starts) | {s + 1 for s in starts}
    for i in range(len(t)):
        if i in short:  # fewer than two earlier positions in the document
            assert (row[i], sign[i]) == (bigram_rows + rows - 1, 0)
        else:
            assert row[i] == bigram_rows + ((17351 * t[i]) ^ (60961 * t[i - 1]) ^ (45259 * t[i - 2])) % (rows - 1)
            assert sign[i] == ((26801 * t[i - 2]) ^ (39779 * t[i - 1]) ^ (58699 * t[i])) % sign_rows
    assert bigram_rows <= row.min() and row.max() == bigram_rows + rows - 1
    brow, _ = tg.bigram_indices(x, cu, bigram_rows, sign_rows)
    assert brow.max() < bigram_rows, "the channels' row ranges do not overlap"


def test_trigram_rows_of_a_document_do_not_depend_on_the_document_before_it():
    x, cu = stream(starts=(0, 100))
    row, sign = tg.trigram_indices(x, cu, 10, 1000, 16)
    for j in (97, 98, 99):  # the first document's last tokens
        x2 = x.clone()
        x2[j] = (x2[j] + 1) % BOS
        row2, sign2 = tg.trigram_indices(x2, cu, 10, 1000, 16)
        changed = ((row2 != row) | (sign2 != sign)).nonzero().flatten().tolist()
        assert changed == [k for k in (j, j + 1, j + 2) if k < 100]


def test_the_ngram_embedding_sums_the_signed_bigram_and_trigram_rows_of_one_table():
    model = tiny_model(randomize=True, trigram_rows=128)
    cfg = model.cfg
    assert model.bigram_embed.weight.shape[0] == TINY["bigram_rows"] + 128
    x, cu = stream(T=128, starts=(0, 60))
    with torch.no_grad():
        got = model.ngram_embedding(x, cu)
        r2, s2 = tg.bigram_indices(x, cu, cfg.bigram_rows, cfg.bigram_sign_rows)
        r3, s3 = tg.trigram_indices(x, cu, cfg.bigram_rows, 128, cfg.bigram_sign_rows)
        w, signs = model.bigram_embed.weight, model.bigram_signs
        torch.testing.assert_close(got, w[r2] * signs[s2] + w[r3] * signs[s3], rtol=0, atol=0)


def test_trigram_rows_zero_leaves_the_model_as_it_was():
    a, b = tiny_model(randomize=True), tiny_model(randomize=True, trigram_rows=0)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="trigram_rows=1"):
        tg.Hyperparameters(**{**TINY, "trigram_rows": 1})


# -- 2. the row-sparse gradient and Adam with exact replay

def test_normalized_token_table_maps_each_token_to_the_first_of_its_normalized_text():
    """PR 375's normalization: case, accents, NFKC forms and whitespace runs fold together, to the smallest id;
    special tokens, bytes that are not UTF-8, tokens that normalize to nothing and padding ids keep their own."""
    vocab = [b" The", b"the", b"THE", b"\xff", None, b"\n\n", b" ", b"caf\xc3\xa9", b"cafe", b"\xef\xac\x81",
             b"fi", b"\xcc\x81", b"\t the  "]
    table = tg.normalized_token_table(vocab, len(vocab) + 2).tolist()
    assert table == [0, 0, 0, 3, 4, 5, 5, 7, 7, 9, 9, 11, 0, 13, 14]
    assert [tg.normalized_text(t) for t in (" The", "\n\n", "caf\u00e9", "\ufb01", "\u0301")] == ["the", " ", "cafe",
                                                                                              "fi", ""]
    with pytest.raises(ValueError, match="ngram_normalize is for GPT-2 tokens: vocab_size=12"):
        tg.normalized_token_table(vocab, 12)


def test_ngram_normalize_hashes_the_normalized_ids_and_reads_the_raw_ones():
    """With ngram_normalize the n-gram rows and signs are those of the normalized stream, the model's tokens stay
    raw: two streams that differ only in a token's case share every n-gram row."""
    vocab = [bytes([97 + i % 26]) if i % 2 else bytes([65 + i % 26]) for i in range(BOS)]  # upper / lower letters
    model = tiny_model(ngram_normalize=True)
    x, cu = stream()
    with pytest.raises(RuntimeError, match="table of normalized ids is not set: call model.set_vocabulary"):
        model.ngram_indices(x, cu)  # built without the vocabulary (as --plan builds it), read before it is set
    model.set_vocabulary(vocab)
    assert model.ngram_ids.tolist()[:BOS] == tg.normalized_token_table(vocab, TINY["vocab_size"]).tolist()[:BOS]
    rows, signs = model.ngram_indices(x, cu)
    plain = tiny_model()
    want = plain.ngram_indices(model.ngram_ids[x.long()].to(x.dtype), cu)
    assert torch.equal(rows, want[0]) and torch.equal(signs, want[1])
    folded = torch.where(x < BOS, model.ngram_ids[x.long()], x).to(x.dtype)
    assert not torch.equal(folded, x) and torch.equal(model.ngram_indices(folded, cu)[0], rows)
    assert not torch.equal(plain.ngram_indices(folded, cu)[0], plain.ngram_indices(x, cu)[0])


def test_a_run_with_ngram_normalize_sets_the_table_from_the_vocabulary_at_start(tiny_args, monkeypatch):
    """The trainer sets the normalized-id table from gpt2_token_bytes before the first step (the model alone, as
    --plan builds it, does not read the vocabulary): a vocabulary whose texts fold nothing trains as the raw hashing
    does, to the bit; one that folds letters' cases changes the losses."""
    kw = dict(FAST, num_iterations=4, val_every=4, warmup_steps=0)
    plain = tg.train(tiny_args(**kw))
    monkeypatch.setattr(tg, "gpt2_token_bytes", lambda: [b"t%d" % i for i in range(BOS)])
    same = tg.train(tiny_args(ngram_normalize=True, **kw))
    monkeypatch.setattr(tg, "gpt2_token_bytes", lambda: CASE_FOLDING_VOCAB)
    folded = tg.train(tiny_args(ngram_normalize=True, **kw))
    assert same.train_losses == plain.train_losses and folded.train_losses != plain.train_losses


def dense_row_adam(p, g, v, t, lr, beta2, eps, wd):
    """The rule row_sparse_adam applies to its rows, on every row of the table (untouched rows: g = 0)."""
    v = beta2 * v + (1 - beta2) * g.square().mean(1)
    u = g / (v.sqrt() + eps)[:, None] * (lr * (1 - beta2**t) ** 0.5)
    u = u + torch.where(u * p > 0, p, 0) * (lr**2 * wd)
    return p - u, v


def caught_up_v(state, beta2s):
    """row_sparse_adam's second moments brought to its current step (what the next lookup of a row applies)."""
    missed = torch.tensor([float(torch.tensor(beta2s[ls:]).double().prod()) for ls in state["last_step"].tolist()])
    return state["exp_avg_sq"] * missed.float()


def test_row_sparse_adam_equals_dense_adam_on_touched_rows_and_exact_replay_on_untouched_rows():
    gen = torch.Generator().manual_seed(0)
    rows, dim, steps = 40, 8, 7
    p0 = torch.randn(rows, dim, generator=gen)
    sparse, dense, v, state = p0.clone(), p0.clone(), torch.zeros(rows), {}
    beta2s, lrs = [0.95, 0.95, 0.9, 0.95, 0.9025, 0.9, 0.95], [0.1, 0.2, 0.15, 0.1, 0.05, 0.1, 0.2]
    last_touched = {}
    for t in range(1, steps + 1):
        touched = torch.randperm(rows, generator=gen)[: 10 + t].sort().values
        if t < steps:  # row 0 sleeps through steps 2..steps-1 (k = steps - 2 zero-gradient steps), woken at the end
            touched = touched[touched != 0] if t > 1 else torch.cat([touched[touched != 0], torch.tensor([0])]).sort().values
        else:
            touched = torch.cat([touched[touched != 0], torch.tensor([0])]).sort().values
        g = torch.zeros(rows, dim)
        g[touched] = torch.randn(touched.numel(), dim, generator=gen)
        lr, b2 = lrs[t - 1], beta2s[t - 1]
        tg.row_sparse_adam(sparse, touched, g[touched], state, lr, b2, 1e-8, 0.5)
        dense, v = dense_row_adam(dense, g, v, t, lr, b2, 1e-8, 0.5)
        for r in range(rows):
            last_touched.setdefault(r, 0)
            if r in touched.tolist():
                last_touched[r] = t
        torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-6)  # untouched rows: the weights did not move
        torch.testing.assert_close(caught_up_v(state, beta2s[:t]), v, rtol=1e-5, atol=0)
    assert last_touched[0] == steps and state["last_step"][0] == steps
    assert (state["last_step"] < steps).any(), "some rows are still behind: their catch-up is pending"


def test_row_sparse_adam_reads_and_writes_only_its_rows():
    p = torch.randn(1000, 4).bfloat16()
    before, state = p.clone(), {}
    rows = torch.tensor([3, 500, 999])
    tg.row_sparse_adam(p, rows, torch.randn(3, 4), state, 0.1, 0.95, 1e-8, 0.1)
    changed = (p != before).any(1).nonzero().flatten()
    assert changed.tolist() == rows.tolist()
    assert state["last_step"].nonzero().flatten().tolist() == rows.tolist() and state["step"] == 1


def test_compiled_row_ops_equal_eager_for_every_row_count_and_step_without_recompiling():
    """build() compiles row_adam_update and segment_sum (dynamic=True): the same numbers as eager through
    row_sparse_adam and the per-row sums, one graph each for every number of rows, step size, decay and beta2 (the
    table's beta2 changes with the schedule; dynamo's limit is 8 graphs, and fullgraph turns hitting it into a
    failure)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counters = [CompileCounterWithBackend("inductor") for _ in range(2)]
    row_update = torch.compile(tg.row_adam_update, backend=counters[0], dynamic=True, fullgraph=True)
    segment = torch.compile(tg.segment_sum, backend=counters[1], dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    eager, comp = (torch.randn(500, 16, generator=gen) * 0.05).bfloat16(), None
    comp, states = eager.clone(), ({}, {})
    for step, n in enumerate([40, 40, 120, 7, 300]):  # lookups this step
        ids = torch.randint(0, 500, (n,), generator=gen)
        logged = torch.randn(n, 16, generator=gen).bfloat16()
        rows, inverse = torch.unique(ids, return_inverse=True)
        sums = tg.segment_sum(inverse, logged, rows.numel())
        torch.testing.assert_close(segment(inverse, logged, rows.numel()), sums, rtol=1e-6, atol=1e-6)
        lr, beta2 = 0.02 / (step + 1), 0.95 if step < 3 else 0.95**2
        tg.row_sparse_adam(eager, rows, sums, states[0], lr, beta2, 1e-10, 5.0)
        tg.row_sparse_adam(comp, rows, sums, states[1], lr, beta2, 1e-10, 5.0, update=row_update)
        torch.testing.assert_close(comp.float(), eager.float(), rtol=1e-2, atol=1e-4)  # bf16: a last-bit rounding
        torch.testing.assert_close(states[1]["exp_avg_sq"], states[0]["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert (comp != (torch.randn(500, 16, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()).any()
    assert [c.frame_count for c in counters] == [1, 1]


def test_dist_adam_takes_the_compiled_row_ops_as_build_gives_them():
    """build_optimizers hands DistAdam its row_update and segment (build passes the compiled twins)."""
    args = tg.Hyperparameters(**{**TINY, "ngram_sparse_adam": True, "trigram_rows": 64})
    model = tiny_model(randomize=True, ngram_sparse_adam=True, trigram_rows=64)
    marks = []
    adam, _ = tg.build_optimizers(model, args, 0, 1, row_update=lambda *a: marks.append("row") or tg.row_adam_update(*a),
                                  segment=tg.segment_sum)
    w = model.bigram_embed.weight
    w.sparse_grad = (torch.tensor([1, 7, 300]), torch.randn(3, w.size(1)))
    adam.step()
    assert marks == ["row"] and adam.segment is tg.segment_sum


def test_a_row_logged_table_gets_no_float32_sum_of_its_shape(monkeypatch):
    """keep_table_grads(positions) makes no table-shaped float32 buffer for the n-gram table, not even for a moment:
    at 21M rows it would be 65 GB beside the table's 32.5 GB (seen as ~96 GB held on an H200)."""
    model = tiny_model(ngram_sparse_adam=True, trigram_rows=512)
    made, zeros_like = [], torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda t, **kw: made.append(tuple(t.shape)) or zeros_like(t, **kw))
    model.keep_table_grads(64)
    table = tuple(model.bigram_embed.weight.shape)
    assert table not in made and model.bigram_embed.grad_sum is None
    assert tuple(model.embed.weight.shape) in made  # the other tables still sum densely
    made.clear()
    tiny_model(trigram_rows=512).keep_table_grads(0)  # the dense Adam's table sums as the other tables do
    assert table in made


def test_the_ngram_log_gives_the_tables_gradient_on_its_looked_up_rows():
    """keep_table_grads(positions): the n-gram lookups log rows and gradients, flushed as (distinct rows, sums) equal
    to the dense table gradient (TableLookup's sum) on those rows; no dense gradient of the table is made."""
    x, cu = stream(T=128, starts=(0, 60))
    y = torch.randint(0, BOS, (128,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    grads = {}
    for sparse in (False, True):
        model = tiny_model(randomize=True, trigram_rows=128)
        model.keep_table_grads(64 if sparse else 0)  # room for 64 lookups: the log grows to the micro-batch's 256
        model.note_token_lookups()
        model.reserve_ngram_log(x.numel())
        model(x, y, cu, 128, tg.window_tokens(3, TINY["window_block"])).backward()
        model.flush_table_grads()
        w = model.bigram_embed.weight
        grads[sparse] = w.sparse_grad if sparse else w.grad.float()
        assert sparse == (w.grad is None)
    rows, g = grads[True]
    r2, _ = tg.bigram_indices(x, cu, TINY["bigram_rows"], TINY["bigram_sign_rows"])
    r3, _ = tg.trigram_indices(x, cu, TINY["bigram_rows"], 128, TINY["bigram_sign_rows"])
    assert torch.equal(rows, torch.cat([r2, r3]).unique())
    torch.testing.assert_close(g, grads[False][rows], rtol=1e-2, atol=1e-6)  # the dense path hands .grad in bf16
    others = torch.ones(grads[False].size(0), dtype=torch.bool).index_fill_(0, rows, False)
    assert grads[False][others].abs().max() == 0


def test_the_flush_planned_before_the_last_forward_is_the_flushs_own():
    """plan_ngram_flush before a step's last micro-batch (after its reserve_ngram_log): the flush then takes the rows
    found from the log so far and that micro-batch's rows, the same rows and sums as its own unique after the last
    backward; a plan made for another log length (a micro-batch more) is not used; zero_table_grads drops it."""
    x, cu = stream(T=128, starts=(0, 60))
    y = torch.randint(0, BOS, (128,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    x2 = torch.randint(0, BOS, (128,), generator=torch.Generator().manual_seed(6), dtype=torch.int32)
    windows = tg.window_tokens(3, TINY["window_block"])
    flushed = {}
    for planned in ("no", "yes", "stale"):
        model = tiny_model(randomize=True, trigram_rows=128)
        model.keep_table_grads(64)  # grows at the first micro-batch's reserve, as a warm-up's would
        model.note_token_lookups()
        for i, inputs in enumerate((x, x2)):
            model.reserve_ngram_log(inputs.numel())
            if i == 1 and planned == "yes":
                model.plan_ngram_flush(inputs, cu)
            if i == 0 and planned == "stale":
                model.plan_ngram_flush(inputs, cu)
            model(inputs, y, cu, 128, windows).backward()
        unique, calls = torch.unique, []
        if planned == "yes":
            n, route = model.ngram_flush_plan[0], model.ngram_flush_plan[-1]
            assert n == model.ngram_logged == 2 * 2 * 128 and route is None  # one GPU: nothing to push
            torch.unique = lambda *a, **k: calls.append(1) or unique(*a, **k)  # the flush must not need its own
        try:
            model.flush_table_grads()
        finally:
            torch.unique = unique
        assert model.ngram_flush_plan is None and not calls
        flushed[planned] = model.bigram_embed.weight.sparse_grad
    for planned in ("yes", "stale"):
        assert torch.equal(flushed[planned][0], flushed["no"][0]) and torch.equal(flushed[planned][1], flushed["no"][1])
    model.plan_ngram_flush(x, cu)
    model.zero_table_grads()
    assert model.ngram_flush_plan is None


def test_dist_adam_steps_the_sparse_group_by_row_sparse_adam():
    args = tg.Hyperparameters(**{**TINY, "ngram_sparse_adam": True, "trigram_rows": 64})
    model = tiny_model(randomize=True, ngram_sparse_adam=True, trigram_rows=64)
    adam, _ = tg.build_optimizers(model, args, 0, 1)
    w = model.bigram_embed.weight
    sparse_groups = [grp for grp in adam.param_groups if grp.get("sparse_rows")]
    assert len(sparse_groups) == 1 and sparse_groups[0]["params"] == [w] and sparse_groups[0]["betas"][0] == 0
    assert all(w is not q for grp in adam.param_groups if not grp.get("sparse_rows") for q in grp["params"])
    rows, g = torch.tensor([1, 7, 300]), torch.randn(3, w.size(1))
    expected, state = w.detach().clone(), {}
    grp = sparse_groups[0]
    tg.row_sparse_adam(expected, rows, g, state, grp["lr"], grp["betas"][1], grp["eps"],
                       grp["weight_decay"])  # one GPU: the flush's float32 sums go to the optimizer as they are
    w.sparse_grad = (rows, g)
    adam.step()
    assert torch.equal(w.detach(), expected) and w.sparse_grad is None


# -- 3. the table sharded by owner (ANVIL2, 08/30/26): each rank holds rows / world_size rows; rows and gradients
# travel by all-to-all to and from their owners only

def test_each_rank_holds_its_block_of_the_table_and_the_rows_must_split_evenly():
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**{**TINY, "trigram_rows": 512}))
    for world in (1, 2, 4):
        shapes = {tg.GPT(cfg, tg.ModelKernels(), (rank, world)).bigram_embed.weight.shape for rank in range(world)}
        assert shapes == {((TINY["bigram_rows"] + 512) // world, TINY["model_dim"])}
    sparse = tg.Hyperparameters(**{**TINY, "trigram_rows": 512, "ngram_sparse_adam": True})
    assert tg.ngram_shard(sparse, 3, 4) == (3, 4) and tg.ngram_shard(tg.Hyperparameters(**TINY), 3, 4) == (0, 1)
    odd = tg.ModelConfig.from_args(tg.Hyperparameters(**{**TINY, "trigram_rows": 514}))  # 770 rows
    with pytest.raises(ValueError, match=r"^the n-gram table's 770 rows \(bigram_rows \+ trigram_rows\) do not split "
                                         r"over 4 GPUs .*: use --trigram_rows 512$") as e:
        tg.GPT(odd, tg.ModelKernels(), (0, 4))
    assert "\n" not in str(e.value)
    tg.check_ngram_shards(256, 514, 2)  # 770 rows split over 2
    with pytest.raises(ValueError, match=r"use --bigram_rows 256$"):
        tg.check_ngram_shards(257, 0, 2)  # no trigram channel: the bigram rows are the fix
    with pytest.raises(ValueError, match=r"use --trigram_rows 8$"):
        tg.check_ngram_shards(256, 3, 8)  # rounding down would leave fewer than 2 rows: rounded up


def _push_worker(rank, world_size, out, drop_received):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    shard = 48 // world_size
    p = torch.nn.Parameter(torch.zeros(shard, 4))  # rows rank x shard .. of a 48-row table
    adam = tg.DistAdam([dict(params=[p], sparse_rows=True, lr=0.1, weight_decay=0.0, betas=(0.0, 0.95))],
                       lr=0.1, betas=(0.0, 0.95), eps=1e-8, rank=rank, world_size=world_size)
    if drop_received:  # a broken exchange, to show the test would see it: each owner keeps only its own rank's rows
        push = tg.push_row_grads
        tg.push_row_grads = lambda rows, grads, n, w, route: (((rows[rows // n == rank], grads[rows // n == rank]), []))
    for step in range(2):
        p.sparse_grad = _rank_rows(rank, step)
        adam.step()
    if drop_received:
        tg.push_row_grads = push
    torch.save(p.detach(), out.format(rank))
    dist.destroy_process_group()


def _rank_rows(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    rows = torch.randperm(48, generator=g)[: 9 + 5 * rank].sort().values  # overlapping, unequal row sets
    return rows, torch.randn(rows.numel(), 4, generator=g)


def _pushed_tables(world_size, drop_received=False):
    import tempfile
    from distributed import spawn
    with tempfile.TemporaryDirectory() as d:
        out = d + "/rank{}.pt"
        spawn(_push_worker, world_size, out, drop_received)
        return [torch.load(out.format(r)) for r in range(world_size)]


@pytest.mark.slow
def test_gloo_ranks_push_their_row_gradients_to_the_owners_which_sum_and_update_their_shards():
    p, state = torch.zeros(48, 4), {}
    for step in range(2):  # one process: the ranks' gradients summed, the whole table's row-sparse step
        dense = torch.zeros(48, 4)
        for rank in range(4):
            rows, g = _rank_rows(rank, step)
            dense[rows] += g
        touched = dense.abs().sum(1).nonzero().flatten()
        tg.row_sparse_adam(p, touched, dense[touched], state, 0.1, 0.95, 1e-8, 0.0)
    shards = _pushed_tables(4)
    assert [s.shape for s in shards] == [(12, 4)] * 4
    torch.testing.assert_close(torch.cat(shards), p, rtol=1e-6, atol=1e-7)
    broken = torch.cat(_pushed_tables(4, drop_received=True))
    assert (broken - p).abs().max() > 0.05, "dropping the received gradients changes the owners' rows"


def _train_worker(rank, world_size, args, out):
    pushes = {"planned": 0, "unplanned": 0}  # how each Adam step's row push found its split sizes and owners' rows
    for name, kind in (("plan_row_push", "planned"), ("push_row_grads", "unplanned")):
        def counted(*a, real=getattr(tg, name), kind=kind, **k):
            pushes[kind] += kind == "planned" or a[-1] is None  # a push without a route: unplanned
            return real(*a, **k)
        setattr(tg, name, counted)
    run = tg.train(args)
    if rank == 0:
        torch.save((run.train_losses, run.val_losses, run.checkpoint, pushes), out)


@pytest.mark.slow
def test_the_sharded_table_trains_on_2_and_4_gloo_processes_as_on_one(tiny_args, tmp_path):
    """The same global batch (4 micro-batches a step) on 1, 2 and 4 processes, Adam every second step: the losses
    (training and validation: both read the table through the pulled row caches) and the table rows after 6 steps
    agree to float32 rounding (the micro-batches' gradients summed in another order); each rank's checkpoint file
    holds its block of rows / world_size rows, model.pt none. Through the sampled softmax's path too, switched to
    the full softmax at step 5, as the record preset runs them together: with every row a candidate (the sweep's
    rows differ by rank and world size, so fewer rows would not give equal losses). Every Adam step's push to the
    owners planned before the step's last forward (plan_row_push)."""
    from distributed import spawn
    sampled = tuple(dataclasses.replace(row, candidates=TINY["vocab_size"]) for row in TINY["stages"])
    common = dict(batch_size=4 * 128, num_iterations=6, val_every=3, save_every=6, ngram_sparse_adam=True,
                  trigram_rows=512, stages=sampled, full_softmax_from=0.8)
    one = tg.train(tiny_args(**common, run_id="one"))
    one_table = torch.load(Path(one.checkpoint) / "model.pt", weights_only=True)["model"]["bigram_embed.weight"]
    assert one_table.shape == (768, 64) and one_table.abs().sum(1).count_nonzero() > 100, "the table learned"
    for world in (2, 4):
        out = str(tmp_path / f"{world}.pt")
        spawn(_train_worker, world, tiny_args(**common, run_id=f"on{world}"), out)
        train, val, checkpoint, pushes = torch.load(out)
        assert pushes["planned"] > 0 and pushes["unplanned"] == 0, pushes  # every push planned before its last forward
        torch.testing.assert_close(torch.tensor(train), torch.tensor(one.train_losses), rtol=1e-4, atol=0)
        torch.testing.assert_close(torch.tensor([v for _, v in val]), torch.tensor([v for _, v in one.val_losses]),
                                   rtol=1e-4, atol=0)
        meta = torch.load(Path(checkpoint) / "model.pt", weights_only=True)
        assert meta["ngram_shards"] == world and "bigram_embed.weight" not in meta["model"]
        shards = [torch.load(Path(checkpoint) / f"rank{r}.pt", weights_only=True)["ngram_table"] for r in range(world)]
        assert [s.shape for s in shards] == [(768 // world, 64)] * world
        table = tg.ngram_table_rows(Path(checkpoint), meta, 0, 1)  # joined whole, as sample.py reads it
        torch.testing.assert_close(table, one_table, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_the_tables_longer_adam_period_trains_on_2_gloo_processes_as_on_one(tiny_args, tmp_path):
    """table_adam_every (4, 0.3) over 8 steps, Adam every second step: the value-embedding and sharded n-gram tables
    step at steps 1, 3 and 7 only, their gradients summed since their last step (on two processes the n-gram rows'
    pushes too, planned before the table step's last forward, none on Adam's step 5). The losses agree with one
    process to float32 rounding, and differ from the run without the period (so the period was in effect)."""
    from distributed import spawn
    common = dict(batch_size=4 * 128, num_iterations=8, val_every=4, save_every=8, ngram_sparse_adam=True,
                  trigram_rows=512)
    one = tg.train(tiny_args(**common, table_adam_every=(4, 0.3), run_id="one"))
    plain = tg.train(tiny_args(**common, run_id="plain"))
    assert one.train_losses[:4] == plain.train_losses[:4] and one.train_losses[-1] != plain.train_losses[-1]
    out = str(tmp_path / "2.pt")
    spawn(_train_worker, 2, tiny_args(**common, table_adam_every=(4, 0.3), run_id="on2"), out)
    train, val, _, pushes = torch.load(out)
    assert pushes == {"planned": 3, "unplanned": 0}, pushes  # the table's steps 1, 3 and 7
    torch.testing.assert_close(torch.tensor(train), torch.tensor(one.train_losses), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in val]), torch.tensor([v for _, v in one.val_losses]),
                               rtol=1e-4, atol=0)



def test_spread_rows_give_every_gpus_block_its_share_of_the_bigram_channel():
    """ngram_spread stores row r at r x NGRAM_SPREAD_MULT mod rows, a bijection of the record's table: in row order
    the first 4 of 8 GPUs own the 10,575,360 bigram rows (half the table); scattered, each block holds an eighth of
    them (to 0.1%)."""
    record = tg.parse_args(["--preset", "record"])
    rows = record.bigram_rows + record.trigram_rows
    scattered = torch.arange(rows) * tg.NGRAM_SPREAD_MULT % rows
    assert torch.equal(scattered.sort().values, torch.arange(rows))  # a bijection
    bigram = scattered[: record.bigram_rows]
    for world in (2, 4, 8):
        per_gpu = torch.bincount(bigram // (rows // world), minlength=world)
        assert (per_gpu - record.bigram_rows / world).abs().max() < 1e-3 * record.bigram_rows / world, per_gpu
    in_row_order = torch.bincount(torch.arange(record.bigram_rows) // (rows // 8), minlength=8)
    assert in_row_order.tolist() == [rows // 8] * 4 + [0] * 4
    fix = f"use --trigram_rows {2 * tg.NGRAM_SPREAD_MULT - 11}"  # 8 fewer: a multiple of the prime no more
    with pytest.raises(ValueError, match=f"multiple of its multiplier .*: {fix}"):
        tg.Hyperparameters(**{**TINY, "ngram_spread": True, "bigram_rows": 3,
                              "trigram_rows": 2 * tg.NGRAM_SPREAD_MULT - 3})


def test_a_spread_table_is_the_same_model_relabelled(tiny_args):
    """The table starts at zero and every row is looked up by its scattered place alone, so a run with ngram_spread
    trains as one without it: the same losses, and its table is the other's rows moved to their places."""
    common = dict(num_iterations=4, val_every=2, save_every=4, ngram_sparse_adam=True, trigram_rows=512)
    plain = tg.train(tiny_args(**common, run_id="plain"))
    spread = tg.train(tiny_args(**common, ngram_spread=True, run_id="spread"))
    torch.testing.assert_close(torch.tensor(spread.train_losses), torch.tensor(plain.train_losses), rtol=1e-6, atol=0)
    assert spread.val_losses == plain.val_losses or torch.allclose(
        torch.tensor([v for _, v in spread.val_losses]), torch.tensor([v for _, v in plain.val_losses]), rtol=1e-6)
    table = lambda run: torch.load(Path(run.checkpoint) / "model.pt", weights_only=True)["model"]["bigram_embed.weight"]
    rows = 256 + 512
    moved = table(spread)[torch.arange(rows) * tg.NGRAM_SPREAD_MULT % rows]
    assert table(plain).abs().sum(1).count_nonzero() > 50, "the table learned"
    torch.testing.assert_close(moved, table(plain), rtol=1e-5, atol=1e-7)



def test_a_checkpoint_from_before_the_spread_field_reads_as_the_row_order_it_was(tiny_args, tmp_path):
    """A checkpoint written before ngram_spread existed stored its table in row order: it resumes as spread false
    (the model fields match), and a spread run refuses it, naming the field."""
    run = tg.train(tiny_args(num_iterations=2, val_every=0, save_every=2, run_id="old"))
    meta = torch.load(Path(run.checkpoint) / "model.pt", weights_only=False)
    del meta["args"]["ngram_spread"]
    torch.save(meta, Path(run.checkpoint) / "model.pt")
    assert tg.Hyperparameters(**tg.stored_args(meta["args"])).ngram_spread is False
    again = dict(num_iterations=4, val_every=0, resume=str(run.checkpoint), checkpoint_dir=str(tmp_path / "ck2"))
    assert tg.train(tiny_args(**again, run_id="again")).train_losses  # resumed: steps 3 and 4
    with pytest.raises(ValueError, match="ngram_spread: checkpoint False, now True"):
        tg.train(tiny_args(**again, ngram_spread=True, run_id="spread"))

@pytest.mark.slow
def test_a_spread_table_trains_on_2_gloo_processes_as_on_one_with_the_bigram_rows_on_both(tiny_args, tmp_path):
    """ngram_spread on 2 gloo processes: the losses and the joined table as on one process (float32 rounding), and
    both GPUs' blocks hold learned bigram rows (in row order the tiny table's 256 bigram rows are all in the first
    block of 384)."""
    from distributed import spawn
    common = dict(batch_size=4 * 128, num_iterations=4, val_every=2, save_every=4, ngram_sparse_adam=True,
                  trigram_rows=512, ngram_spread=True)
    one = tg.train(tiny_args(**common, run_id="one"))
    out = str(tmp_path / "2.pt")
    spawn(_train_worker, 2, tiny_args(**common, run_id="on2"), out)
    train, val, checkpoint, _ = torch.load(out)
    torch.testing.assert_close(torch.tensor(train), torch.tensor(one.train_losses), rtol=1e-4, atol=0)
    meta = torch.load(Path(checkpoint) / "model.pt", weights_only=True)
    table = tg.ngram_table_rows(Path(checkpoint), meta, 0, 1)
    one_table = torch.load(Path(one.checkpoint) / "model.pt", weights_only=True)["model"]["bigram_embed.weight"]
    torch.testing.assert_close(table, one_table, rtol=1e-3, atol=1e-4)
    bigram_places = torch.arange(256) * tg.NGRAM_SPREAD_MULT % 768
    learned = bigram_places[table[bigram_places].abs().sum(1) > 0]
    assert (learned < 384).any() and (learned >= 384).any(), "bigram rows learned in both blocks"

def _plan_ahead_worker(rank, world_size, args, out):
    pulls = {"planned": 0, "now": 0}  # how each pull found its split sizes: planned ahead, or at the pull
    flushes = {"ahead": 0, "before its forward": 0}  # over which group each flush's push was planned
    real_pull, real_push = tg.pull_rows, tg.plan_row_push

    def pull(table, wanted, rows, r, w, plan=None):
        pulls["planned" if plan is not None else "now"] += 1
        return real_pull(table, wanted, rows, r, w, plan)

    def push(rows, shard_rows, r, w, group=None):
        flushes["ahead" if group is not None else "before its forward"] += 1
        return real_push(rows, shard_rows, r, w, group)
    tg.pull_rows, tg.plan_row_push = pull, push
    run = tg.train(args)
    if rank == 0:
        torch.save((run.train_losses, run.val_losses, pulls, flushes), out)


@pytest.mark.slow
def test_pulls_and_flushes_planned_a_micro_batch_ahead_train_exactly_as_planned_at_once(tiny_args, tmp_path):
    """ngram_plan_ahead on 2 gloo processes, Adam (and the tables) every second step: each pull's questions go over
    the planning group while the micro-batch before runs (within a step, and the next step's first from
    BatchLoader.peek), the rows after the optimizers; so does a table step's flush plan, with the pull of the step's
    last micro-batch. The same losses to the bit as all planned at once, at 2 micro-batches a rank and at 1 (the
    8-GPU record's shape, where the next flush is planned in the step before, across that step's own flush). Only
    the first step's first pull and evaluate's are planned at the pull."""
    from distributed import spawn
    for micros in (2, 1):
        common = dict(batch_size=2 * micros * 128, num_iterations=6, val_every=3, ngram_sparse_adam=True,
                      trigram_rows=512)
        runs = {}
        for ahead in (False, True):
            out = str(tmp_path / f"{micros}_{ahead}.pt")
            spawn(_plan_ahead_worker, 2, tiny_args(**common, ngram_plan_ahead=ahead, run_id=f"a{micros}{ahead}"), out)
            runs[ahead] = torch.load(out)
        (train, val, pulls, flushes), (train_ahead, val_ahead, pulls_ahead, flushes_ahead) = runs[False], runs[True]
        assert train_ahead == train and val_ahead == val, micros
        evaluations = pulls["now"] - 6 * micros  # 6 steps' micro-batches; the rest are evaluate's
        assert pulls["planned"] == 0 and evaluations > 0
        assert pulls_ahead == {"planned": 6 * micros - 1, "now": 1 + evaluations}, pulls_ahead
        assert flushes == {"ahead": 0, "before its forward": 3}  # the table steps 1, 3 and 5
        assert flushes_ahead == {"ahead": 3, "before its forward": 0}, flushes_ahead

# -- 4. the memory table and the start-up refusal

def test_the_ngram_memory_table_is_its_parts_arithmetic():
    rows, dim, n, m = 1_000_000, 768, 10_000, 3_000
    dense = tg.ngram_memory(rows, dim, 4, n, sparse=False, cache_positions=m)
    assert dense == {"weights": 2 * rows * dim, "Adam state": 8 * rows * dim // 4, "gradients": 6 * rows * dim,
                     "row cache": 0}
    bf16_row, fp32_row = 8 + 2 * dim, 8 + 4 * dim
    one = tg.ngram_memory(rows, dim, 1, n, sparse=True, cache_positions=m)
    # one GPU: the whole table, the log (id + bf16 row) and own sums (id + fp32 row) of n positions, no row cache
    assert one == {"weights": 2 * rows * dim, "Adam state": 8 * rows, "gradients": n * (bf16_row + fp32_row),
                   "row cache": 0}
    for world in (2, 4, 8):
        got = tg.ngram_memory(rows, dim, world, n, sparse=True, cache_positions=m)
        R = rows // world
        # the shard's weights and state; the sums sent, every rank's received (worst case) and their fp32 sums; the
        # micro-batch's cache (bf16 rows and ids) and the rows it serves every rank (worst case)
        assert got == {"weights": 2 * R * dim, "Adam state": 8 * R,
                       "gradients": n * (bf16_row + fp32_row) + n * bf16_row + world * n * bf16_row
                       + world * n * fp32_row,
                       "row cache": m * (2 * dim + 24) + world * m * bf16_row}
    # beyond the weights, the dense table's gradients and moments scale with its rows, the sparse one's with its lookups
    assert sum(dense.values()) - dense["weights"] > 50 * (sum(one.values()) - one["weights"])
    # a shard smaller than the lookups bounds what one owner receives and serves
    small = tg.ngram_memory(8_000, dim, 8, n, sparse=True, cache_positions=m)
    assert small["gradients"] == n * (bf16_row + fp32_row) + n * bf16_row + 8 * 1000 * bf16_row + 1000 * fp32_row


def test_the_sharded_tables_bytes_per_gpu_shrink_with_the_gpus_as_the_formula_says():
    """ANVIL2's 84.6M rows x 768 at the record's batch (49,152 tokens per rank at 8 GPUs): the weights and state per
    GPU are the whole table's / world_size; the total falls with every doubling of the GPUs (the worst-case exchange
    buffers, about every rank's lookups, do not shrink: 8 GPUs hold 1/5 of one GPU's bytes, not 1/8)."""
    args = tg.parse_args(ANVIL2_TABLE)
    rows, gib = 84_602_880, 2**30
    parts = {w: tg.ngram_memory_of(args, w) for w in (1, 2, 4, 8)}
    for w, m in parts.items():
        assert m["weights"] == 2 * rows * 768 // w and m["Adam state"] == 8 * rows // w
    totals = [sum(parts[w].values()) for w in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and totals[0] / totals[3] > 5
    assert 120 < parts[1]["weights"] / gib < 122 and 15 < parts[8]["weights"] / gib < 15.2  # 121 GiB whole, 15.1 a GPU


def test_plan_prints_the_tables_bytes_per_gpu_for_1_2_4_and_8_gpus(capsys):
    assert tg.main(["--plan", "--bigram_rows", "377280", "--trigram_rows", "1000000"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("n-gram table 377,280 bigram + 1,000,000 trigram"))
    assert "row-sparse Adam, sharded by owner" in out[at]
    assert out[at + 1].split() == ["GPUs", "weights", "Adam", "state", "gradients", "row", "cache", "total"]
    assert [line.split()[0] for line in out[at + 2: at + 6]] == ["1", "2", "4", "8"]
    args = tg.parse_args(["--bigram_rows", "377280", "--trigram_rows", "1000000"])
    schedule = tg.Schedule(args)
    for line, world in zip(out[at + 2: at + 6], (1, 2, 4, 8)):
        m = tg.ngram_memory(1_377_280, 768, world, tg.ngram_positions(schedule, world), True,
                            tg.ngram_cache_positions(schedule))
        assert line.split()[1:] == [f"{m[k] / 2**30:.2f}" for k in ("weights", "Adam state", "gradients", "row cache")] \
            + [f"{sum(m.values()) / 2**30:.2f}"]
    assert tg.ngram_positions(schedule, 8) == max(st.spec.batch_size for st in schedule.stages) // 8 * args.adam_every * 2
    assert tg.ngram_cache_positions(schedule) == max(st.spec.seq_len for st in schedule.stages) * 2


def test_a_table_too_large_for_the_gpu_is_refused_in_one_line_naming_the_fix():
    args = tg.parse_args(ANVIL2_TABLE)
    with pytest.raises(ValueError, match=r"n-gram table of 84,602,880 rows .*fewer rows .*--preset single") as e:
        tg.check_memory_fits(args, 1, 141 * 2**30, tg.ModelKernels())  # whole on one GPU: 121 GiB of weights + more
    assert "\n" not in str(e.value)
    tg.check_memory_fits(args, 8, 141 * 2**30, tg.ModelKernels())  # sharded over 8: 15.1 GiB of weights a GPU
    with pytest.raises(ValueError, match=r"n-gram table of 84,602,880 rows .*more GPUs"):
        tg.check_memory_fits(args, 8, 24 * 2**30, tg.ModelKernels())  # but not on 8 GPUs of 24 GiB
    tg.check_memory_fits(tg.parse_args([]), 8, 80 * 2**30, tg.ModelKernels())  # the record fits an H100
    # the record's 21M-row table whole on one GPU of 40 GiB, and the single preset's 5.0M rows on 24 GiB: refused, the
    # fixes named only where not taken already (the record's table is row-sparse; single is single)
    with pytest.raises(ValueError, match=r"of 21,150,720 rows 37\.2 of it\), the GPU has 40\.0 GiB: use fewer rows "
                                         r"\(--bigram_rows, --trigram_rows\), more GPUs or --preset single$"):
        tg.check_memory_fits(tg.parse_args([]), 1, 40 * 2**30, tg.ModelKernels())
    with pytest.raises(ValueError, match=r"of 5,000,000 rows 14\.0 of it\), .*: use fewer rows \(--bigram_rows, "
                                         r"--trigram_rows\) or more GPUs$"):
        tg.check_memory_fits(tg.parse_args(["--preset", "single"]), 1, 24 * 2**30, tg.ModelKernels())
