// Causal grouped-query attention over the KV cache, flash style (online softmax, no score matrix).
//
// Query token t (absolute position pos + t) of head qh attends to cache rows 0..pos+t with
// KV head qh / G, weights softmax(q . k * SCALE).
//
// One workgroup = one KV head x BQ consecutive tokens: NQ = BQ * G query rows share every K/V row
// it loads. Key rows are walked in tiles of TILE rows (TILE * HD / 4 = 2 * WG, so each invocation
// loads 2 vec4 of K and 2 of V per tile, coalesced, the next tile's loads issued before the current
// tile's arithmetic). Per tile, from workgroup memory:
//   1. scores: invocation (query i / TILE, row i % TILE) dots its query with its K row;
//   2. online softmax: invocation qi < NQ takes its query's tile max and rescale factor, then every
//      score becomes p = exp(s - m_new), then invocation qi < NQ adds its query's p to the running sum;
//   3. values (alongside the sum): invocation (query i / C4, column i % C4) rescales its accumulator
//      and adds p * V.
// With LANES (one token per workgroup, subgroups of at least LANES invocations, checked at run time,
// else the tile walk above), `attend_lanes` walks the rows without any barrier instead: LANES
// consecutive invocations (a lane group, inside one subgroup) share one K/V row, lane i holding vec4
// columns i * VPL .. i * VPL + VPL - 1 of the head, so a row is one coalesced load of the group; each
// of the NLG lane groups takes LANE_ROWS rows per step (row = step base + u * NLG + group), sums its
// lanes' partial scores by xor shuffles (every lane ends with the same sum) and keeps its own online
// softmax and accumulators in registers. After the walk every group writes its (m, l, acc) to
// workgroup memory and, after one barrier, one invocation per (query head, column) merges them in
// group order, so a token's result depends on its position only, as for the tile walk.
// Why this shape (measured on an H100 through wgpu/naga): one workgroup streams only ~30 GB/s from
// L2, so every K/V element is loaded from memory once per workgroup and long contexts are split over
// many workgroups; the driver does not unroll naga's loops and each iteration waits for its loads
// (~100 cycles even from workgroup memory), so the inner loops over a tile are unrolled in the text
// (//#for, 8 independent loads per step; SCORE_ITERS = C4 / 8, TILE_ITERS = TILE / 8), and the
// per-query reductions are short unrolled sums rather than barrier-separated trees.
//
// SPLIT = false (prefill): the workgroup walks every tile up to its last token's row and writes
//   out [T, HQ*HD] f32 = acc / l. Dispatch (1, HKV, ceil(T / BQ)).
// SPLIT = true (decode): the n_tiles = ceil((pos + t + 1) / TILE) tiles are dealt to
//   n_splits = min(n_tiles, MAX_SPLITS) workgroups (ceil(n_tiles / n_splits) consecutive tiles each,
//   _split_plan.wgsl),
//   or to one workgroup while the token's row is within the first DIRECT_TILES tiles (where a decode
//   step runs SPLIT = false: one workgroup walks every tile); each writes its unnormalized partial
//   (acc, m, l) for attention_combine.wgsl. BQ must be 1. A token's partials depend on its own
//   position only, never on how many tokens the step holds, so a speculative verify row rounds
//   exactly as the decode step of that token would (greedy output identical to plain decoding).
//   Dispatch (>= n_splits, HKV, T); workgroups without tiles exit at once. A token whose rows fit in
//   DIRECT_TILES tiles has one split: its workgroup writes acc / l to direct_out itself, as SPLIT = false
//   would, and the combine leaves that token at once. (A queued verify step knows only an upper bound
//   of its position, so it takes the split kernels even where its rows fit; docs/performance.md,
//   session 20.) Every SPLIT kernel is built with DIRECT_OUT.
//
// Variants (one entry point, `main`; defines pick its prologue):
//   plain      queries from `q` (RoPE already applied, K/V rows already appended by rope.wgsl).
//   ROPE       decode of one token with RoPE fused in (saves rope.wgsl's dispatch): binding 1 is then
//              the fused projection qkv, and the queries are rotated on load; row pos (rotated k,
//              plain v) is computed in registers, used in place of the cache row by the walk's
//              loads, and appended to the cache by the workgroup whose tiles hold it (nothing in the
//              dispatch reads it back from memory). n_tokens must be 1. Rotation as in rope.wgsl;
//              needs ROPE_DIM % 8 == 0.
//   DRAFT_ROWS (BQ = 1): ROPE for the T <= MAX_DRAFT rows of a speculative verify step, one token
//              per workgroup row z. Token t's workgroups rotate rows pos .. pos + t of their KV head
//              (the draft's rows up to t) into workgroup memory, so no workgroup waits for another's
//              append; each token's row is appended by the workgroup whose tiles hold it. Row for
//              row what ROPE computes for that token's decode step (the same rotation and packing,
//              the same walk), so verify rows round exactly as decode steps.
//
// Bindings (plain uses 0-5, ROPE and DRAFT_ROWS 0-6):
//   0 params   uniform StepParams
//   1 q        plain: [T, HQ * HD] f32 (vec4), rotated queries;
//              ROPE, DRAFT_ROWS: qkv [T, (HQ + 2 * HKV) * HD] f32 (vec4), fused projection (q, k, v heads)
//   2 k_cache  [capacity, HKV * HD] f16 pairs in u32, KVWord per 4 values (_kv.wgsl; f32 with
//              KV_F32) (read_write only for the append)
//   3 v_cache  [capacity, HKV * HD] likewise
//   4 out      SPLIT: partial acc [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS, HD] f32; else [T, HQ * HD] f32
//   5 stats    SPLIT: partial (m, l) [MAX_TOKENS_SPLIT, HQ, MAX_SPLITS] vec2<f32>; else not written
//   6 table    ROPE, DRAFT_ROWS: [n_positions, ROPE_DIM / 2] (cos, sin) pairs, read as vec4 (two pairs)
//   DIRECT_OUT_BINDING (6 plain, 7 with ROPE or DRAFT_ROWS) direct_out  SPLIT: [T, HQ * HD] f32 (vec4), the
//              attention output of a token whose rows fit one split (see SPLIT above)

${STEP_PARAMS}
//#include _kv

const HQ: u32 = ${HQ};
const HKV: u32 = ${HKV};
const HD: u32 = ${HD};
const BQ: u32 = ${BQ};
const TILE: u32 = ${TILE};
const WG: u32 = ${WG};
const SPLIT: bool = ${SPLIT};
const MAX_SPLITS: u32 = ${MAX_SPLITS};
const SPLIT_CAP: u32 = ${SPLIT_CAP};  // _split_plan.wgsl: most splits a token uses (partial slots: MAX_SPLITS)
const DIRECT_TILES: u32 = ${DIRECT_TILES};
const SCALE: f32 = ${SCALE};
const ROPE_DIM: u32 = ${ROPE_DIM};
const NEOX: bool = ${NEOX};
//#include _split_plan

const G: u32 = HQ / HKV;            // query heads per KV head
const C4: u32 = HD / 4u;            // vec4 columns of one head
const NQ: u32 = BQ * G;             // query rows of one workgroup, index qi = b * G + (qh % G)
const KS_ROW: u32 = C4 + 1u;        // padded K row in workgroup memory: no bank conflicts
const LOAD_ROWS: u32 = WG / C4;     // tile rows covered by one load of every invocation
const Q_ROW4: u32 = HQ * C4;
const KV_ROW4: u32 = HKV * C4;
const NEG: f32 = -3.0e38;           // "minus infinity" that stays finite through subtraction

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<KVWord>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<KVWord>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> stats: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read> table: array<vec4<f32>>;
//#if DIRECT_OUT
@group(0) @binding(${DIRECT_OUT_BINDING}) var<storage, read_write> direct_out: array<vec4<f32>>;
//#else
const_assert !SPLIT;  // the combine skips one-split tokens: a split kernel must write their output
//#endif

var<workgroup> ks: array<vec4<f32>, TILE * KS_ROW>;  // K tile [TILE, C4 (+1 pad)]
var<workgroup> vs: array<vec4<f32>, TILE * C4>;      // V tile [TILE, C4]
var<workgroup> qs: array<vec4<f32>, NQ * C4>;        // queries * SCALE [NQ, C4]
var<workgroup> probs: array<f32, NQ * TILE>;         // scores, then p [NQ, TILE]
var<workgroup> m_run: array<f32, NQ>;                // running max score per query
var<workgroup> l_run: array<f32, NQ>;                // running sum of exp(score - m_run) per query
var<workgroup> alpha: array<f32, NQ>;                // exp(m_old - m_new) of the current tile
//#if DRAFT_ROWS
const MAX_DRAFT: u32 = ${MAX_DRAFT};
const QKV_ROW4: u32 = (HQ + 2u * HKV) * C4;
var<workgroup> draft_k: array<KVWord, MAX_DRAFT * C4>;  // rows pos .. pos + t of this KV head, packed
var<workgroup> draft_v: array<KVWord, MAX_DRAFT * C4>;
//#endif
//#if LANES
const LANES: u32 = ${LANES};            // invocations per K/V row (a power of two, <= the subgroup size)
const VPL: u32 = ${LANE_VECS};          // vec4 columns per lane: C4 / LANES
const NLG: u32 = ${LANE_GROUPS};        // lane groups walking rows (a power of two <= WG / LANES)
const LANE_ROWS: u32 = ${LANE_ROWS};    // rows per lane group and step
const STEP_ROWS: u32 = NLG * LANE_ROWS;
// The lane groups' partials for the merge: (m, l) here, acc in `ks` then `vs` (merge_store).
var<workgroup> merge_ml: array<vec2<f32>, NLG * G>;
const KS_LEN: u32 = TILE * KS_ROW;
const_assert NLG * G * C4 <= KS_LEN + TILE * C4;  // kernels/attention.py lane_shape keeps NLG within it
const_assert G * C4 <= WG;  // one merging invocation per (query head, column)
var<workgroup> lanes_ok_wg: u32;
//#if ROPE
var<workgroup> new_kv: array<KVWord, 2u * C4>;  // ROPE's row pos of this KV head: K, then V
//#endif
//#endif

// Max of probs[b .. b + 8].
fn max8(b: u32) -> f32 {
    return max(max(max(probs[b], probs[b + 1u]), max(probs[b + 2u], probs[b + 3u])),
               max(max(probs[b + 4u], probs[b + 5u]), max(probs[b + 6u], probs[b + 7u])));
}

// The first tile's cache words of this invocation (rows lr and lr + LOAD_ROWS of the workgroup's
// first tile, column lc), loaded before any other work of the kernel: their memory latency then
// overlaps the RoPE prologue and the append. Rows this step computes itself are replaced in attend.
struct FirstLoads {
    k_a: KVWord,
    k_b: KVWord,
    v_a: KVWord,
    v_b: KVWord,
};

struct NewRow {
    k: KVWord,
    v: KVWord,
};

fn first_loads(tid: u32, kvh: u32, w: Work) -> FirstLoads {
    let last_row = w.kv_len - 1u;
    let col = kvh * C4 + tid % C4;
    let at_a = min(w.tile_begin * TILE + tid / C4, last_row) * KV_ROW4 + col;
    let at_b = min(w.tile_begin * TILE + tid / C4 + LOAD_ROWS, last_row) * KV_ROW4 + col;
    return FirstLoads(k_cache[at_a], k_cache[at_b], v_cache[at_a], v_cache[at_b]);
}

// Which rows this workgroup attends over; `ok` is false for workgroups with nothing to do.
struct Work {
    ok: bool,
    t0: u32,          // first token of this workgroup
    kv_len: u32,      // rows visible to its last token
    tile_begin: u32,
    tile_end: u32,
    whole: bool,      // SPLIT: the token's rows fit one split, whose workgroup writes the output itself
};

fn plan(wid: vec3<u32>) -> Work {
    var w: Work;
    w.t0 = wid.z * BQ;
    w.ok = w.t0 < params.n_tokens;
    w.kv_len = params.pos + min(w.t0 + BQ, params.n_tokens);
    let n_tiles = (w.kv_len + TILE - 1u) / TILE;
    w.tile_begin = 0u;
    w.tile_end = n_tiles;
    w.whole = false;
    if (SPLIT) {
        let n_splits = split_count(w.kv_len, n_tiles);
        w.whole = n_splits == 1u;
        let per_split = (n_tiles + n_splits - 1u) / n_splits;
        w.tile_begin = wid.x * per_split;
        w.tile_end = min(n_tiles, w.tile_begin + per_split);
        w.ok = w.ok && w.tile_begin < w.tile_end;
    }
    return w;
}

// Column c (vec4) of the head starting at vec4 `head` of qkv (binding 1), rotated for `position`.
fn rope_vec4(head: u32, c: u32, position: u32) -> vec4<f32> {
    let x = q[head + c];
    if (4u * c >= ROPE_DIM) {
        return x;
    }
    let row = position * (ROPE_DIM / 4u);   // table vec4s per position
    if (NEOX) {
        // Dims 4c..4c+3 pair with the same dims of the other half (rotate-half).
        let half4 = ROPE_DIM / 8u;
        let first = c < half4;
        let j = select(c - half4, c, first);
        let partner = q[head + select(c - half4, c + half4, first)];
        let cs01 = table[row + 2u * j];
        let cs23 = table[row + 2u * j + 1u];
        let cos = vec4<f32>(cs01.x, cs01.z, cs23.x, cs23.z);
        let sin = vec4<f32>(cs01.y, cs01.w, cs23.y, cs23.w);
        return x * cos + select(partner, -partner, first) * sin;
    }
    // Interleaved: pairs (x, y) and (z, w) use frequencies 2c and 2c + 1.
    let cs = table[row + c];
    return vec4<f32>(x.x * cs.x - x.y * cs.y, x.y * cs.x + x.x * cs.y,
                     x.z * cs.z - x.w * cs.w, x.w * cs.z + x.z * cs.w);
}

// Pre-scaled queries of this workgroup into qs; rows of tokens past n_tokens are zero.
fn fill_queries(tid: u32, kvh: u32, w: Work) {
    if (tid < NQ * C4) {
        let qi = tid / C4;
        let t = w.t0 + qi / G;
        let qh = kvh * G + qi % G;
        var value = vec4<f32>(0.0);
        if (t < params.n_tokens) {
            value = q[t * Q_ROW4 + qh * C4 + tid % C4] * SCALE;
        }
        qs[tid] = value;
    }
}

//#if LANES
// Whether this workgroup takes the lane-group walk: its subgroups hold whole lane groups.
fn lanes_fit(tid: u32, sg_size: u32) -> bool {
    if (tid == 0u) {
        lanes_ok_wg = select(0u, 1u, sg_size >= LANES);
    }
    return workgroupUniformLoad(&lanes_ok_wg) == 1u;
}

// The lane walk's first step of loads (see lane_loads), issued before the prologue.
fn lane_first_loads(tid: u32, kvh: u32, w: Work) -> LaneLoads {
    return lane_loads(tid / LANES, tid % LANES, kvh, w.tile_begin * TILE, lane_last_row(w));
}
//#endif

//#if ROPE
// ROPE's prologue: queries rotated into qs; row pos of this KV head (rotated k, plain v) computed
// by every invocation for its own column (all loads independent) and appended by the workgroup whose
// tiles hold it (nothing in this dispatch reads it back from memory). Packed as stored, so this step
// sees the row exactly as later steps will read it.
fn rope_prologue(tid: u32, kvh: u32, w: Work) -> NewRow {
    let pos = params.pos;
    let row = NewRow(kv_pack(rope_vec4((HQ + kvh) * C4, tid % C4, pos)), kv_pack(q[(HQ + HKV + kvh) * C4 + tid % C4]));
    if (tid < NQ * C4) {
        qs[tid] = rope_vec4((kvh * G + tid / C4) * C4, tid % C4, pos) * SCALE;
    }
    if (pos < w.tile_end * TILE && pos >= w.tile_begin * TILE && pos < params.kv_capacity && tid < C4) {
        k_cache[pos * KV_ROW4 + kvh * C4 + tid] = row.k;
        v_cache[pos * KV_ROW4 + kvh * C4 + tid] = row.v;
    }
//#if LANES
    if (tid < C4) {  // the lane walk reads other invocations' columns
        new_kv[tid] = row.k;
        new_kv[C4 + tid] = row.v;
    }
//#endif
    return row;
}

//#endif

//#if DRAFT_ROWS
// DRAFT_ROWS' prologue: rows pos .. pos + t of this KV head into workgroup memory (as ROPE
// computes its row pos, packed as stored), token t's rotated queries into qs, and token t's row
// appended by the workgroup whose tiles hold it (nothing in this dispatch reads it back).
fn draft_prologue(tid: u32, kvh: u32, w: Work) {
    let t = w.t0;
    let pos = params.pos;
    for (var i = tid; i < (t + 1u) * C4; i += WG) {
        let j = i / C4;
        draft_k[i] = kv_pack(rope_vec4(j * QKV_ROW4 + (HQ + kvh) * C4, i % C4, pos + j));
        draft_v[i] = kv_pack(q[j * QKV_ROW4 + (HQ + HKV + kvh) * C4 + i % C4]);
    }
    if (tid < NQ * C4) {
        qs[tid] = rope_vec4(t * QKV_ROW4 + (kvh * G + tid / C4) * C4, tid % C4, pos + t) * SCALE;
    }
    workgroupBarrier();
    let row = pos + t;
    if (row < w.tile_end * TILE && row >= w.tile_begin * TILE && row < params.kv_capacity && tid < C4) {
        k_cache[row * KV_ROW4 + kvh * C4 + tid] = draft_k[t * C4 + tid];
        v_cache[row * KV_ROW4 + kvh * C4 + tid] = draft_v[t * C4 + tid];
    }
}
//#endif

// What a workgroup does before its walk: the queries of plain `main`, or the ROPE or DRAFT_ROWS
// prologue (each variant only calls its own, so a pipeline binds only the buffers it reads).
fn prologue(tid: u32, kvh: u32, w: Work) -> NewRow {
    var row = NewRow(kv_zero(), kv_zero());
//#if DRAFT_ROWS
    draft_prologue(tid, kvh, w);
//#else
//#if ROPE
    row = rope_prologue(tid, kvh, w);
//#else
    fill_queries(tid, kvh, w);
//#endif
//#endif
    return row;
}

// The tile walk takes row pos from the prologue's registers (ROPE); DRAFT_ROWS reads its rows from
// workgroup memory instead (k_or_draft).
//#if ROPE
const HAS_NEW: bool = true;
//#else
const HAS_NEW: bool = false;
//#endif

// The plan, the first loads (issued before the prologue, so their latency overlaps it), the prologue,
// then the lane-group walk or the tile walk.
@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
//#if LANES
        @builtin(subgroup_size) sg_size: u32,
//#endif
) {
    let w = plan(wid);
    if (!w.ok) {
        return;
    }
//#if LANES
    if (lanes_fit(tid, sg_size)) {
        let first = lane_first_loads(tid, wid.y, w);
        prologue(tid, wid.y, w);
        attend_lanes(tid, wid, w, first);
        return;
    }
//#endif
    let first = first_loads(tid, wid.y, w);
    let row = prologue(tid, wid.y, w);
    attend(tid, wid, w, first, HAS_NEW, row.k, row.v);
}

//#if DRAFT_ROWS
// Row `row` at this invocation's column (lc within the head), given its cache word: rows from pos on
// are the draft's, from workgroup memory.
fn k_or_draft(cached: KVWord, row: u32, lc: u32) -> KVWord {
    let pos = params.pos;
    return select(cached, draft_k[min(row - pos, MAX_DRAFT - 1u) * C4 + lc], row >= pos);
}

fn v_or_draft(cached: KVWord, row: u32, lc: u32) -> KVWord {
    let pos = params.pos;
    return select(cached, draft_v[min(row - pos, MAX_DRAFT - 1u) * C4 + lc], row >= pos);
}

fn k_row(row: u32, head_col: u32, lc: u32) -> KVWord {
    return k_or_draft(k_cache[row * KV_ROW4 + head_col], row, lc);
}

fn v_row(row: u32, head_col: u32, lc: u32) -> KVWord {
    return v_or_draft(v_cache[row * KV_ROW4 + head_col], row, lc);
}
//#endif

// The tile walk shared by the entry points; qs must be written (the first barrier orders it).
// With `has_new`, cache row pos is taken as (new_k, new_v) (this invocation's column) instead of
// being loaded.
fn attend(tid: u32, wid: vec3<u32>, w: Work, first: FirstLoads, has_new: bool, new_k: KVWord, new_v: KVWord) {
    let kvh = wid.y;
    let n_tokens = params.n_tokens;
    let pos = params.pos;
    let t0 = w.t0;
    let kv_len = w.kv_len;
    let tile_begin = w.tile_begin;
    let tile_end = w.tile_end;

    // This invocation's share of each tile load: rows lr and lr + LOAD_ROWS, column lc.
    let lr = tid / C4;
    let lc = tid % C4;
    let last_row = kv_len - 1u;
    let head_col = kvh * C4 + lc;
    let new_row = select(0xffffffffu, pos, has_new);
    var base = tile_begin * TILE;
    var row_a = min(base + lr, last_row);
    var row_b = min(base + lr + LOAD_ROWS, last_row);
//#if DRAFT_ROWS
    var k_a = k_or_draft(first.k_a, row_a, lc);
    var k_b = k_or_draft(first.k_b, row_b, lc);
    var v_a = v_or_draft(first.v_a, row_a, lc);
    var v_b = v_or_draft(first.v_b, row_b, lc);
//#else
    var k_a = select(first.k_a, new_k, row_a == new_row);
    var k_b = select(first.k_b, new_k, row_b == new_row);
    var v_a = select(first.v_a, new_v, row_a == new_row);
    var v_b = select(first.v_b, new_v, row_b == new_row);
//#endif

    if (tid < NQ) {
        m_run[tid] = NEG;
        l_run[tid] = 0.0;
    }

    let sq = tid / TILE;               // score phase: query and row of this invocation
    let sr = tid % TILE;
    let s_limit = pos + t0 + sq / G;   // last row query sq may see
    let vq = tid / C4;                 // value phase: query and column of this invocation
    var acc = vec4<f32>(0.0);

    for (var tile = tile_begin; tile < tile_end; tile++) {
        base = tile * TILE;
        ks[lr * KS_ROW + lc] = kv_unpack(k_a);
        ks[(lr + LOAD_ROWS) * KS_ROW + lc] = kv_unpack(k_b);
        vs[lr * C4 + lc] = kv_unpack(v_a);
        vs[(lr + LOAD_ROWS) * C4 + lc] = kv_unpack(v_b);
        workgroupBarrier();

        // Issue the next tile's loads now; they land while this tile is computed.
        let next = min(tile + 1u, tile_end - 1u) * TILE;
        row_a = min(next + lr, last_row);
        row_b = min(next + lr + LOAD_ROWS, last_row);
//#if DRAFT_ROWS
        k_a = k_row(row_a, head_col, lc);
        k_b = k_row(row_b, head_col, lc);
        v_a = v_row(row_a, head_col, lc);
        v_b = v_row(row_b, head_col, lc);
//#else
        k_a = select(k_cache[row_a * KV_ROW4 + head_col], new_k, row_a == new_row);
        k_b = select(k_cache[row_b * KV_ROW4 + head_col], new_k, row_b == new_row);
        v_a = select(v_cache[row_a * KV_ROW4 + head_col], new_v, row_a == new_row);
        v_b = select(v_cache[row_b * KV_ROW4 + head_col], new_v, row_b == new_row);
//#endif

        // 1. scores.
        if (sq < NQ) {
            let row = base + sr;
            var s = NEG;
            if (row <= s_limit && row < kv_len) {
                let qb = sq * C4;
                let kb = sr * KS_ROW;
                var d = 0.0;
//#for i in SCORE_ITERS
                {
                    let c = {{i}}u * 8u;
                    d += dot(qs[qb + c], ks[kb + c]) + dot(qs[qb + c + 1u], ks[kb + c + 1u])
                       + dot(qs[qb + c + 2u], ks[kb + c + 2u]) + dot(qs[qb + c + 3u], ks[kb + c + 3u])
                       + dot(qs[qb + c + 4u], ks[kb + c + 4u]) + dot(qs[qb + c + 5u], ks[kb + c + 5u])
                       + dot(qs[qb + c + 6u], ks[kb + c + 6u]) + dot(qs[qb + c + 7u], ks[kb + c + 7u]);
                }
//#endfor
                s = d;
            }
            probs[tid] = s;
        }
        workgroupBarrier();

        // 2. online softmax: new running max and the factor rescaling what was summed so far.
        if (tid < NQ) {
            var m = m_run[tid];
//#for i in TILE_ITERS
            m = max(m, max8(tid * TILE + {{i}}u * 8u));
//#endfor
            alpha[tid] = exp(m_run[tid] - m);
            m_run[tid] = m;
        }
        workgroupBarrier();
        if (sq < NQ) {
            let s = probs[tid];
            probs[tid] = select(exp(s - m_run[sq]), 0.0, s == NEG);
        }
        workgroupBarrier();
        if (tid < NQ) {
            var l = 0.0;
//#for i in TILE_ITERS
            {
                let b = tid * TILE + {{i}}u * 8u;
                l += probs[b] + probs[b + 1u] + probs[b + 2u] + probs[b + 3u]
                   + probs[b + 4u] + probs[b + 5u] + probs[b + 6u] + probs[b + 7u];
            }
//#endfor
            l_run[tid] = l_run[tid] * alpha[tid] + l;
        }

        // 3. acc = acc * alpha + sum over the tile's rows of p * V[row, col].
        if (vq < NQ) {
            var a = acc * alpha[vq];
//#for i in TILE_ITERS
            {
                let pb = vq * TILE + {{i}}u * 8u;
                let vb = {{i}}u * 8u * C4 + lc;
                a += probs[pb] * vs[vb] + probs[pb + 1u] * vs[vb + C4] + probs[pb + 2u] * vs[vb + 2u * C4]
                   + probs[pb + 3u] * vs[vb + 3u * C4] + probs[pb + 4u] * vs[vb + 4u * C4]
                   + probs[pb + 5u] * vs[vb + 5u * C4] + probs[pb + 6u] * vs[vb + 6u * C4]
                   + probs[pb + 7u] * vs[vb + 7u * C4];
            }
//#endfor
            acc = a;
        }
        workgroupBarrier();
    }

    let t = t0 + vq / G;
    if (vq < NQ && t < n_tokens) {
        let qh = kvh * G + vq % G;
        if (SPLIT && !w.whole) {
            let slot = (t * HQ + qh) * MAX_SPLITS + wid.x;
            out[slot * C4 + lc] = acc;
            if (lc == 0u) {
                stats[slot] = vec2<f32>(m_run[vq], l_run[vq]);
            }
        } else if (SPLIT) {
//#if DIRECT_OUT
            direct_out[t * Q_ROW4 + qh * C4 + lc] = acc / l_run[vq];
//#endif
        } else {
            out[t * Q_ROW4 + qh * C4 + lc] = acc / l_run[vq];
        }
    }
}

//#if LANES
// ---- The lane-group walk (see the top): rows r_begin .. r_end - 1 of this workgroup ----

// The K and V words of this lane for the LANE_ROWS rows of one step (rows past the last re-read it).
struct LaneLoads {
//#for u in LANE_ROWS
//#for j in LANE_VECS
    k{{u}}_{{j}}: KVWord,
    v{{u}}_{{j}}: KVWord,
//#endfor
//#endfor
};

// Element i of the lane merge's acc partials [NLG, G, C4], spread over the K and V tiles' memory.
fn merge_store(i: u32, v: vec4<f32>) {
    if (i < KS_LEN) {
        ks[i] = v;
    } else {
        vs[i - KS_LEN] = v;
    }
}

fn merge_load(i: u32) -> vec4<f32> {
    if (i < KS_LEN) {
        return ks[i];
    }
    return vs[i - KS_LEN];
}

// Last row this workgroup attends over.
fn lane_last_row(w: Work) -> u32 {
    return min(w.tile_end * TILE, w.kv_len) - 1u;
}

// Lane `lane` of lane group `lg`: its columns of rows base + u * NLG + lg (u < LANE_ROWS).
fn lane_loads(lg: u32, lane: u32, kvh: u32, base: u32, last: u32) -> LaneLoads {
    let col = kvh * C4 + lane * VPL;
    var o: LaneLoads;
//#for u in LANE_ROWS
    {
        let at = min(base + {{u}}u * NLG + lg, last) * KV_ROW4 + col;
//#for j in LANE_VECS
        o.k{{u}}_{{j}} = k_cache[at + {{j}}u];
        o.v{{u}}_{{j}} = v_cache[at + {{j}}u];
//#endfor
    }
//#endfor
    return o;
}

// Row `row`'s word at head column c as this step sees it: rows the step computes itself come from
// workgroup memory (ROPE's row pos, or the draft's rows from pos on).
fn lane_k(cached: KVWord, row: u32, c: u32) -> KVWord {
//#if DRAFT_ROWS
    return k_or_draft(cached, row, c);
//#else
//#if ROPE
    return select(cached, new_kv[c], row == params.pos);
//#else
    return cached;
//#endif
//#endif
}

fn lane_v(cached: KVWord, row: u32, c: u32) -> KVWord {
//#if DRAFT_ROWS
    return v_or_draft(cached, row, c);
//#else
//#if ROPE
    return select(cached, new_kv[C4 + c], row == params.pos);
//#else
    return cached;
//#endif
//#endif
}

// The walk; `first` holds the first step's loads. qs (and new_kv / draft rows) are written before the
// first barrier here. Writes what `attend` writes for a one-token workgroup.
fn attend_lanes(tid: u32, wid: vec3<u32>, w: Work, first: LaneLoads) {
    let kvh = wid.y;
    let lg = tid / LANES;
    let lane = tid % LANES;
    let walks = lg < NLG;
    let r_begin = w.tile_begin * TILE;
    let last = lane_last_row(w);
    let r_end = last + 1u;
    let c0 = lane * VPL;
    workgroupBarrier();
//#for g in GQ
//#for j in LANE_VECS
    let q{{g}}_{{j}} = qs[{{g}}u * C4 + c0 + {{j}}u];
    var acc{{g}}_{{j}} = vec4<f32>(0.0);
//#endfor
    var m{{g}} = NEG;
    var l{{g}} = 0.0;
//#endfor

    var cur = first;
    let n_steps = (r_end - r_begin + STEP_ROWS - 1u) / STEP_ROWS;  // uniform: the shuffles need it
    for (var step = 0u; step < n_steps; step++) {
        let base = r_begin + step * STEP_ROWS;
        // The next step's loads first; they land while this step is computed.
        let next = lane_loads(lg, lane, kvh, min(base + STEP_ROWS, last), last);
//#for u in LANE_ROWS
        let row{{u}} = base + {{u}}u * NLG + lg;
        let ok{{u}} = walks && row{{u}} < r_end;
        let rr{{u}} = min(row{{u}}, last);
//#for j in LANE_VECS
        let k{{u}}_{{j}} = kv_unpack(lane_k(cur.k{{u}}_{{j}}, rr{{u}}, c0 + {{j}}u));
        let v{{u}}_{{j}} = kv_unpack(lane_v(cur.v{{u}}_{{j}}, rr{{u}}, c0 + {{j}}u));
//#endfor
//#for g in GQ
        var s{{u}}_{{g}} = 0.0;
//#for j in LANE_VECS
        s{{u}}_{{g}} += dot(q{{g}}_{{j}}, k{{u}}_{{j}});
//#endfor
//#endfor
//#endfor
        // Each score summed over its lane group: xor partners stay inside the aligned group.
//#for e in LANE_LEVELS
//#for u in LANE_ROWS
//#for g in GQ
        s{{u}}_{{g}} += subgroupShuffleXor(s{{u}}_{{g}}, LANES >> ({{e}}u + 1u));
//#endfor
//#endfor
//#endfor
        // Online softmax per query head, once per step.
//#for g in GQ
        {
            var mx = m{{g}};
//#for u in LANE_ROWS
            mx = max(mx, select(NEG, s{{u}}_{{g}}, ok{{u}}));
//#endfor
            let rescale = exp(m{{g}} - mx);
            m{{g}} = mx;
            var l = l{{g}} * rescale;
//#for j in LANE_VECS
            var a{{j}} = acc{{g}}_{{j}} * rescale;
//#endfor
//#for u in LANE_ROWS
            {
                let p = select(0.0, exp(s{{u}}_{{g}} - mx), ok{{u}});
                l += p;
//#for j in LANE_VECS
                a{{j}} += p * v{{u}}_{{j}};
//#endfor
            }
//#endfor
            l{{g}} = l;
//#for j in LANE_VECS
            acc{{g}}_{{j}} = a{{j}};
//#endfor
        }
//#endfor
        cur = next;
    }

    // Merge the lane groups in one round: every walking group writes its partials ((m, l) to merge_ml,
    // acc to the tiles' memory, which the lane walk does not use), then invocation i < G * C4 merges
    // column i % C4 of query head i / C4 over the groups, in group order.
    if (walks) {
//#for g in GQ
        if (lane == 0u) {
            merge_ml[lg * G + {{g}}u] = vec2<f32>(m{{g}}, l{{g}});
        }
//#for j in LANE_VECS
        merge_store((lg * G + {{g}}u) * C4 + c0 + {{j}}u, acc{{g}}_{{j}});
//#endfor
//#endfor
    }
    workgroupBarrier();
    if (tid < G * C4) {
        let g = tid / C4;
        let col = tid % C4;
        var mx = NEG;
//#for i in LANE_GROUPS
        mx = max(mx, merge_ml[{{i}}u * G + g].x);
//#endfor
        var l = 0.0;
        var acc = vec4<f32>(0.0);
//#for i in LANE_GROUPS
        {
            let ml = merge_ml[{{i}}u * G + g];
            let p = exp(ml.x - mx);  // a group that saw no row: m = NEG, l = 0, acc = 0
            l += p * ml.y;
            acc += p * merge_load(({{i}}u * G + g) * C4 + col);
        }
//#endfor
        let t = w.t0;
        let qh = kvh * G + g;
        if (SPLIT && !w.whole) {
            let slot = (t * HQ + qh) * MAX_SPLITS + wid.x;
            out[slot * C4 + col] = acc;
            if (col == 0u) {
                stats[slot] = vec2<f32>(mx, l);
            }
        } else if (SPLIT) {
//#if DIRECT_OUT
            direct_out[t * Q_ROW4 + qh * C4 + col] = acc / l;
//#endif
        } else {
            out[t * Q_ROW4 + qh * C4 + col] = acc / l;
        }
    }
}
//#endif
