// Ternary (I2_S) matrix x int8 matrix: the prefill BitLinear for T > 1 token rows.
//
//   y[t, n] = wscale[n] * xscale[t] * sum_k (code[n, k] - 1) * xq[t, k]
//
// Same math, weight layout and epilogues as ternary_gemv.wgsl (see there); this kernel reuses
// every loaded weight word across a tile of TT tokens instead of re-reading it per token.
//
// Bindings:
//   0 params   uniform StepParams    n_tokens bounds the token rows
//   1 weights  [N, K/64] vec4<u32>   2-bit codes (x86 I2_S rows)
//   2 wscale   [N] f32
//   3 xq       [T, K/16] vec4<u32>   int8 activations
//   4 xscale   [T] f32
//   5 out      [T, OUT_W] f32
//
// Mapping: a workgroup of TX*TY threads owns a tile of RT = TX*MR weight rows x TT = TY*MT tokens.
// Per 128-value block of K it stages the tile's weight words (RT x 8 u32) and activation words
// (TT x 32 u32) in workgroup memory; thread (tx, ty) accumulates local rows tx + TX*i and tokens
// ty + TY*m. Gated epilogues: local rows 0..RT/2-1 are gate rows, RT/2.. the matching up rows, so
// a thread's accumulator i pairs with i + MR/2.
// Dispatch: (ceil(OUT_W / (RT or RT/2)), ceil(n_tokens / TT), 1).

${STEP_PARAMS}

const K: u32 = ${K};
const N: u32 = ${N};
const EPILOGUE: u32 = ${EPILOGUE};
const TX: u32 = ${TX};
const TY: u32 = ${TY};
const MR: u32 = ${MR};
const MT: u32 = ${MT};

const RT: u32 = TX * MR;
const TT: u32 = TY * MT;
const WG: u32 = TX * TY;
const CHUNKS: u32 = K / 64u;
const BLOCKS: u32 = K / 128u;
const XROW: u32 = K / 16u;
const GATED: bool = EPILOGUE >= 2u;
const HALF: u32 = N / 2u;
const OUT_W: u32 = select(N, HALF, GATED);
const OUT_TILE: u32 = select(RT, RT / 2u, GATED);
const W_STRIDE: u32 = 9u;   // 8 words per row + 1 pad: rows tx + TX*i fall in distinct banks
const X_STRIDE: u32 = 33u;  // 32 words per token + 1 pad
const W_ITEMS: u32 = (RT * 2u + WG - 1u) / WG;
const X_ITEMS: u32 = (TT * 8u + WG - 1u) / WG;
const CODE_MASK: u32 = 0x03030303u;
const ONES: u32 = 0x01010101u;

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> wscale: array<f32>;
@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> xscale: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> w_tile: array<u32, RT * W_STRIDE>;
var<workgroup> x_tile: array<u32, TT * X_STRIDE>;

//#if DOT4
fn dot4(a: u32, b: u32) -> i32 {
    return dot4I8Packed(a, b);
}
//#else
fn dot4(a: u32, b: u32) -> i32 {
    let s = bitcast<i32>(b);
    return i32(a & 0xffu) * ((s << 24u) >> 24u) + i32((a >> 8u) & 0xffu) * ((s << 16u) >> 24u)
         + i32((a >> 16u) & 0xffu) * ((s << 8u) >> 24u) + i32(a >> 24u) * (s >> 24u);
}
//#endif

// Global weight row of local tile row lr in row tile rt.
fn global_row(rt: u32, lr: u32) -> u32 {
    if (GATED) {
        let o = rt * OUT_TILE + (lr % OUT_TILE);
        return select(o, HALF + o, lr >= OUT_TILE);
    }
    return rt * RT + lr;
}

fn activate(g: f32) -> f32 {
    if (EPILOGUE == 2u) {
        let r = max(g, 0.0);
        return r * r;
    }
    return g / (1.0 + exp(-g));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let rt = wid.x;
    let t0 = wid.y * TT;
    let n_tokens = params.n_tokens;
    let tx = lid % TX;
    let ty = lid / TX;
    var acc: array<i32, MR * MT>;
    var xsum: array<i32, MT>;

    for (var b = 0u; b < BLOCKS; b++) {
        for (var k = 0u; k < W_ITEMS; k++) {
            let item = lid + k * WG;
            if (item < RT * 2u) {
                let lr = item / 2u;
                let h = item % 2u;
                let v = weights[min(global_row(rt, lr), N - 1u) * CHUNKS + b * 2u + h];
                let base = lr * W_STRIDE + h * 4u;
                w_tile[base] = v.x;
                w_tile[base + 1u] = v.y;
                w_tile[base + 2u] = v.z;
                w_tile[base + 3u] = v.w;
            }
        }
        for (var k = 0u; k < X_ITEMS; k++) {
            let item = lid + k * WG;
            if (item < TT * 8u) {
                let tok = item / 8u;
                let q = item % 8u;
                let v = xq[min(t0 + tok, n_tokens - 1u) * XROW + b * 8u + q];
                let base = tok * X_STRIDE + q * 4u;
                x_tile[base] = v.x;
                x_tile[base + 1u] = v.y;
                x_tile[base + 2u] = v.z;
                x_tile[base + 3u] = v.w;
            }
        }
        workgroupBarrier();
        for (var j = 0u; j < 8u; j++) {
            var xw: array<vec4<u32>, MT>;
            for (var m = 0u; m < MT; m++) {
                let base = (ty + TY * m) * X_STRIDE + j;
                xw[m] = vec4<u32>(x_tile[base], x_tile[base + 8u], x_tile[base + 16u], x_tile[base + 24u]);
                xsum[m] += dot4(ONES, xw[m].x) + dot4(ONES, xw[m].y) + dot4(ONES, xw[m].z) + dot4(ONES, xw[m].w);
            }
            for (var i = 0u; i < MR; i++) {
                let wv = w_tile[(tx + TX * i) * W_STRIDE + j];
                let c0 = (wv >> 6u) & CODE_MASK;
                let c1 = (wv >> 4u) & CODE_MASK;
                let c2 = (wv >> 2u) & CODE_MASK;
                let c3 = wv & CODE_MASK;
                for (var m = 0u; m < MT; m++) {
                    acc[i * MT + m] += dot4(c0, xw[m].x) + dot4(c1, xw[m].y) + dot4(c2, xw[m].z)
                                     + dot4(c3, xw[m].w);
                }
            }
        }
        workgroupBarrier();
    }

    for (var m = 0u; m < MT; m++) {
        let t = t0 + ty + TY * m;
        if (t < n_tokens) {
            let xs = xscale[t];
            if (GATED) {
                for (var i = 0u; i < MR / 2u; i++) {
                    let lr = tx + TX * i;
                    let o = rt * OUT_TILE + lr;
                    if (o < OUT_W) {
                        let gv = wscale[o] * xs * f32(acc[i * MT + m] - xsum[m]);
                        let uv = wscale[HALF + o] * xs * f32(acc[(i + MR / 2u) * MT + m] - xsum[m]);
                        out[t * OUT_W + o] = activate(gv) * uv;
                    }
                }
            } else {
                for (var i = 0u; i < MR; i++) {
                    let n = rt * RT + tx + TX * i;
                    if (n < N) {
                        let y = wscale[n] * xs * f32(acc[i * MT + m] - xsum[m]);
                        if (EPILOGUE == 1u) {
                            out[t * OUT_W + n] += y;
                        } else {
                            out[t * OUT_W + n] = y;
                        }
                    }
                }
            }
        }
    }
}
