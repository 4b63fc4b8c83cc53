// Ternary (I2_S) matrix x int8 vector: the decode-time BitLinear, one token row per workgroup row.
//
//   y[t, n] = wscale[n] * xscale[t] * sum_k (code[n, k] - 1) * xq[t, k]      codes 0, 1, 2 = -1, 0, +1
//
// computed as dot4I8Packed(codes, xq) summed over k, minus sum_k xq[t, k] (code - 1 = value).
// Epilogue (EPILOGUE): 0 store   out[t, n] = y
//                      1 residual out[t, n] += y
//                      2 relu2   out[t, i] = max(g, 0)^2 * u      g = y[t, i], u = y[t, HALF + i]
//                      3 silu    out[t, i] = g * sigmoid(g) * u   (gate rows 0..HALF-1, up rows HALF..N-1)
//
// Weight layout: I2_S rows as in the GGUF file (x86): each row is K/128 blocks of 32 bytes; byte b
// of a block holds values b, 32+b, 64+b, 96+b at shifts 6, 4, 2, 0. So u32 word j (0..7) of a
// block, shifted by 6-2s and masked with 0x03030303, holds the codes of values 4j..4j+3 + 32s,
// which line up with int8 activation word 8s + j of the same block.
//
// Bindings:
//   0 weights  [N, K/64] vec4<u32>   2-bit codes, 16 bytes = 64 values per vec4
//   1 wscale   [N] f32               per-row weight scale (tensors of a fused matrix keep their own)
//   2 xq       [T, K/16] vec4<u32>   int8 activations, 4 per u32
//   3 xscale   [T] f32               1/s of each activation row
//   4 out      [T, OUT_W] f32        OUT_W = N, or N/2 for the gated epilogues
//   5 params   uniform StepParams    only with BOUNDED (a verify step's rows): rows from n_tokens on
//                                    exit at once
//
// Mapping: a workgroup of WG threads computes ROWS accumulators (ROWS output rows, or ROWS/2 gate
// and the ROWS/2 matching up rows) for token t = workgroup_id.y. Thread lid takes 16-byte chunks
// lid, lid+WG, ... (ITERS of them) of each row, loads the 16 matching activation words once and
// reuses them for all ROWS rows; every load is issued before any arithmetic. Per-thread values
// are unrolled `let`s (//#for, see common.unroll_loops), never loop-indexed arrays. Integer
// partials are reduced exactly: subgroupAdd, then one workgroup atomicAdd per subgroup (or per
// thread without subgroups).
// Dispatch: (ceil(OUT_W / OUTS), n_tokens, 1) with OUTS = ROWS (or ROWS/2 gated).

//#if BOUNDED
${STEP_PARAMS}
//#endif
const K: u32 = ${K};
const N: u32 = ${N};
const ROWS: u32 = ${ROWS};
const WG: u32 = ${WG};
const EPILOGUE: u32 = ${EPILOGUE};

const ITERS: u32 = ${ITERS};  // ceil(CHUNKS / WG)
const CHUNKS: u32 = K / 64u;
const XROW: u32 = K / 16u;
const GATED: bool = EPILOGUE >= 2u;
const HALF: u32 = N / 2u;
const OUTS: u32 = select(ROWS, ROWS / 2u, GATED);
const OUT_W: u32 = select(N, HALF, GATED);

@group(0) @binding(0) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> wscale: array<f32>;
@group(0) @binding(2) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> xscale: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
//#if BOUNDED
@group(0) @binding(5) var<uniform> params: StepParams;
//#endif

var<workgroup> acc_wg: array<atomic<i32>, ROWS>;

//#include _ternary_codes
//#include _epilogue


// Weight row of accumulator r in row group g.
fn weight_row(g: u32, r: u32) -> u32 {
    return group_row(g, r, ROWS);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
    let g = wid.x;
    let t = wid.y;
//#if BOUNDED
    if (t >= params.n_tokens) {  // uniform: the whole workgroup leaves
        return;
    }
//#endif
    // All loads first (clamped indices, no branch).
//#for it in ITERS
    let c{{it}} = lid + {{it}}u * WG;
    let live{{it}} = c{{it}} < CHUNKS;
    let cc{{it}} = min(c{{it}}, CHUNKS - 1u);
//#for r in ROWS
    let w{{it}}_{{r}} = weights[min(weight_row(g, {{r}}u), N - 1u) * CHUNKS + cc{{it}}];
//#endfor
    let xb{{it}} = t * XROW + (cc{{it}} / 2u) * 8u + (cc{{it}} % 2u);
    let x{{it}}_0 = xq[xb{{it}}];
    let x{{it}}_1 = xq[xb{{it}} + 2u];
    let x{{it}}_2 = xq[xb{{it}} + 4u];
    let x{{it}}_3 = xq[xb{{it}} + 6u];
//#endfor
    // Explicit zeroing: lavapipe was seen to keep the previous workgroup's values (WGSL promises
    // zero-initialized workgroup memory; not every driver path delivers it for atomics).
    if (lid < ROWS) {  // WG >= ROWS (checked on the host)
        atomicStore(&acc_wg[lid], 0i);
    }
    workgroupBarrier();
//#include _row_dots
//#if SUBGROUPS
    if (sg_lane == 0u) {
//#for r in ROWS
        atomicAdd(&acc_wg[{{r}}], s{{r}});
//#endfor
    }
//#else
//#for r in ROWS
    atomicAdd(&acc_wg[{{r}}], a{{r}} - xsum);
//#endfor
//#endif
    workgroupBarrier();
    if (lid < OUTS) {
        let o = g * OUTS + lid;
        if (o < OUT_W) {
            let y = wscale[weight_row(g, lid)] * xscale[t] * f32(atomicLoad(&acc_wg[lid]));
            var u = 0.0;
            if (GATED) {
                u = wscale[weight_row(g, lid + OUTS)] * xscale[t] * f32(atomicLoad(&acc_wg[lid + OUTS]));
            }
            store_out(t * OUT_W + o, y, u);
        }
    }
}
