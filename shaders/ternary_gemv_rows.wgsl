// Ternary (I2_S) matrix x TOK int8 rows at once: the BitLinear of a speculative verify step (2..9
// token rows), reading each weight once for all rows.
//
//   y[t, n] = wscale[n] * xscale[t] * sum_k (code[n, k] - 1) * xq[t, k]      t = 0..TOK-1
//
// Same weight layout, bindings and epilogues as ternary_gemv.wgsl (see there); the input rows were
// normalized and quantized once by rmsnorm_quant.wgsl, not by every workgroup.
//
// Mapping: a workgroup of WG threads owns ROWS weight rows (ROWS output rows, or ROWS/2 gate and the
// ROWS/2 matching up rows). Thread lid loads its 16-byte chunks lid, lid+WG, ... of those rows into
// registers once, then for each token row t (unrolled, TOK is a constant) loads the 16 matching
// activation words (L1/L2 hits: every workgroup reads the same few KB) and forms ROWS dot products.
// Partials are reduced exactly (subgroupAdd, then one workgroup atomicAdd per subgroup, or per thread
// without subgroups) into TOK * ROWS accumulators; the epilogue applies the per-row scales.
// Dispatch: (ceil(OUT_W / OUTS), 1, 1) with OUTS = ROWS (or ROWS/2 gated).

const TOK: u32 = ${TOK};
const K: u32 = ${K};
const N: u32 = ${N};
const ROWS: u32 = ${ROWS};
const WG: u32 = ${WG};
const EPILOGUE: u32 = ${EPILOGUE};
const ITERS: u32 = ${ITERS};  // ceil(CHUNKS / WG)

const CHUNKS: u32 = K / 64u;
const XROW: u32 = K / 16u;
const ACCS: u32 = TOK * ROWS;  // accumulators: ROWS weight rows x TOK token rows
const GATED: bool = EPILOGUE >= 2u;
const HALF: u32 = N / 2u;
const OUTS: u32 = select(ROWS, ROWS / 2u, GATED);
const OUT_W: u32 = select(N, HALF, GATED);

// weights [N, K/64] vec4, per-row scales [N], int8 rows [TOK, K/16] vec4, row scales [TOK], out
@group(0) @binding(0) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> wscale: array<f32>;
@group(0) @binding(2) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> xscale: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> acc_rows: array<atomic<i32>, ACCS>;  // [t * ROWS + r]

//#include _ternary_codes
//#include _epilogue

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if SUBGROUPS
        @builtin(subgroup_invocation_id) sg_lane: u32,
//#endif
) {
    let g = wid.x;
    // The weight chunks of all ROWS rows, held for every token row (clamped indices, no branch).
//#for it in ITERS
    let c{{it}} = lid + {{it}}u * WG;
    let live{{it}} = c{{it}} < CHUNKS;
    let cc{{it}} = min(c{{it}}, CHUNKS - 1u);
    let xb{{it}} = (cc{{it}} / 2u) * 8u + (cc{{it}} % 2u);  // first activation word of the chunk
//#for r in ROWS
    let w{{it}}_{{r}} = weights[min(group_row(g, {{r}}u, ROWS), N - 1u) * CHUNKS + cc{{it}}];
//#endfor
//#endfor
    // Explicit zeroing (lavapipe was seen to keep a previous workgroup's atomics, see ternary_gemv).
    for (var i = lid; i < ACCS; i += WG) {
        atomicStore(&acc_rows[i], 0i);
    }
    workgroupBarrier();
//#for t in TOK
    {
        let t = {{t}}u;
//#for it in ITERS
        let x{{it}}_0 = xq[t * XROW + xb{{it}}];
        let x{{it}}_1 = xq[t * XROW + xb{{it}} + 2u];
        let x{{it}}_2 = xq[t * XROW + xb{{it}} + 4u];
        let x{{it}}_3 = xq[t * XROW + xb{{it}} + 6u];
//#endfor
//#include _row_dots
//#if SUBGROUPS
        if (sg_lane == 0u) {
//#for r in ROWS
            atomicAdd(&acc_rows[t * ROWS + {{r}}u], s{{r}});
//#endfor
        }
//#else
//#for r in ROWS
        atomicAdd(&acc_rows[t * ROWS + {{r}}u], a{{r}} - xsum);
//#endfor
//#endif
    }
//#endfor
    workgroupBarrier();
    // One output per thread and pass: token row t = i / OUTS, output o of this workgroup's OUTS.
    for (var i = lid; i < TOK * OUTS; i += WG) {
        let t = i / OUTS;
        let j = i % OUTS;
        let o = g * OUTS + j;
        if (o < OUT_W) {
            let y = wscale[group_row(g, j, ROWS)] * xscale[t] * f32(atomicLoad(&acc_rows[t * ROWS + j]));
            var u = 0.0;
            if (GATED) {
                u = wscale[group_row(g, j + OUTS, ROWS)] * xscale[t] * f32(atomicLoad(&acc_rows[t * ROWS + j + OUTS]));
            }
            store_out(t * OUT_W + o, y, u);
        }
    }
}
