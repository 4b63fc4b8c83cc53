// Ternary (I2_S) matrix x int8 matrix: the prefill BitLinear for T > 1 token rows.
//
//   y[t, n] = wscale[n] * xscale[t] * sum_k (code[n, k] - 1) * xq[t, k]
//
// Same math, weight layout and epilogues as ternary_gemv.wgsl (see there); this kernel reuses
// every loaded weight word across a tile of TT tokens and every activation word across RT rows.
//
// Bindings:
//   0 params   uniform StepParams    n_tokens bounds the token rows
//   1 weights  [N, K/64] vec4<u32>   2-bit codes (x86 I2_S rows)
//   2 wscale   [N] f32
//   3 xq       [T, K/16] vec4<u32>   int8 activations
//   4 xscale   [T] f32
//   5 out      [T, OUT_W] f32
//
// Mapping: a workgroup of TX*TY threads owns a tile of RT = TX*MR weight rows x TT = TY*MT tokens
// and walks K one stage of KB 128-value blocks at a time. Per stage it stages in workgroup memory
//   w_s: each tile row's 32 * KB bytes of codes, decoded ONCE to signed int8 (-1/0/+1, 4 per u32,
//        in activation order: within block bb, u32 word 32bb + 8s + 4h + j <- code word 8bb + 4h + j
//        shifted by 6 - 2s), so the inner loop needs no decoding and no sum(xq) correction;
//   x_s: each tile token's 128 * KB int8 activations;
// rows padded to 8 * KB + 1 vec4 so the vec4 reads of TX different rows hit distinct banks.
// The next stage's global loads are issued into registers before the current stage's arithmetic
// (double buffering through registers). Thread (tx, ty) accumulates local rows
// tx + TX*i and tokens ty + TY*m from vec4 reads: MR + MT vec4 loads per MR*MT*4 dot products. Per-thread
// values are unrolled `let`/`var`s (//#for, see common.unroll_loops), never loop-indexed arrays.
// Gated epilogues: local rows 0..RT/2-1 are gate rows, RT/2.. the matching up rows, so a
// thread's accumulator acc0i (row tx + TX*i) pairs with acc1i (row tx + TX*(MR/2 + i)).
// Dispatch: (ceil(OUT_W / (RT or RT/2)), ceil(n_tokens / TT), 1).

${STEP_PARAMS}

const K: u32 = ${K};
const N: u32 = ${N};
const EPILOGUE: u32 = ${EPILOGUE};
const TX: u32 = ${TX};
const TY: u32 = ${TY};
const MR: u32 = ${MR};
const MT: u32 = ${MT};
const MRH: u32 = MR / 2u;

const RT: u32 = TX * MR;
const TT: u32 = TY * MT;
const WG: u32 = TX * TY;
const CHUNKS: u32 = K / 64u;
const KB: u32 = ${KB};  // 128-value blocks per stage (one barrier pair per stage)
const STAGES: u32 = K / (128u * KB);
const SV: u32 = ${SV};  // = 8 * KB: vec4 of activations (and of decoded weights) per row per stage
const XROW: u32 = K / 16u;
const GATED: bool = EPILOGUE >= 2u;
const HALF: u32 = N / 2u;
const OUT_W: u32 = select(N, HALF, GATED);
const OUT_TILE: u32 = select(RT, RT / 2u, GATED);
const STRIDE: u32 = SV + 1u;  // vec4 per staged row: SV + 1 pad
const WV: u32 = 2u * KB;  // 16-byte code loads per row per stage
const W_ITEMS: u32 = ${W_ITEMS};  // 16-byte code loads per thread per stage: ceil(RT * WV / WG)
const X_ITEMS: u32 = ${X_ITEMS};  // 16-byte activation loads per thread per stage: ceil(TT * SV / WG)

@group(0) @binding(0) var<uniform> params: StepParams;
@group(0) @binding(1) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> wscale: array<f32>;
@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> xscale: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> w_s: array<vec4<u32>, RT * STRIDE>;
var<workgroup> x_s: array<vec4<u32>, TT * STRIDE>;

//#include _ternary_codes
//#include _epilogue

fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4(a.x, b.x) + dot4(a.y, b.y) + dot4(a.z, b.z) + dot4(a.w, b.w);
}

// Codes (0, 1, 2 per 2-bit field) of shift group s -> signed bytes (-1, 0, +1): per byte,
// c + 0x7f is 0x7f..0x81 (no carry), and xor 0x80 maps it to 0xff, 0x00, 0x01.
fn decode(v: vec4<u32>, shift: u32) -> vec4<u32> {
    let c = (v >> vec4<u32>(shift)) & vec4<u32>(CODE_MASK);
    return (c + vec4<u32>(0x7f7f7f7fu)) ^ vec4<u32>(0x80808080u);
}

// Global weight row of local tile row lr in row tile rt.
fn global_row(rt: u32, lr: u32) -> u32 {
    return group_row(rt, lr, RT);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let rt = wid.x;
    let t0 = wid.y * TT;
    let n_tokens = params.n_tokens;
    let tx = lid % TX;
    let ty = lid / TX;

    // Staging items of this thread (fixed for the whole K walk): source index in stage 0, and the
    // workgroup-memory slot it fills.
//#for k in W_ITEMS
    let w_item{{k}} = min(lid + {{k}}u * WG, RT * WV - 1u);
    let w_live{{k}} = lid + {{k}}u * WG < RT * WV;
    let w_src{{k}} = min(global_row(rt, w_item{{k}} / WV), N - 1u) * CHUNKS + w_item{{k}} % WV;
    // code vec4 h of a stage row: block h / 2, half h % 2 -> decoded vec4 8 (h / 2) + h % 2 + 2 s'
    let w_dst{{k}} = (w_item{{k}} / WV) * STRIDE + ((w_item{{k}} % WV) / 2u) * 8u + w_item{{k}} % 2u;
    var w_reg{{k}} = weights[w_src{{k}}];
//#endfor
//#for k in X_ITEMS
    let x_item{{k}} = min(lid + {{k}}u * WG, TT * SV - 1u);
    let x_live{{k}} = lid + {{k}}u * WG < TT * SV;
    let x_src{{k}} = min(t0 + x_item{{k}} / SV, n_tokens - 1u) * XROW + x_item{{k}} % SV;
    let x_dst{{k}} = (x_item{{k}} / SV) * STRIDE + x_item{{k}} % SV;
    var x_reg{{k}} = xq[x_src{{k}}];
//#endfor
    // Accumulator acc{h}{i}_{m}: local row tx + TX * (h * MRH + i), token ty + TY * m.
//#for h in 2
//#for i in MRH
//#for m in MT
    var acc{{h}}{{i}}_{{m}} = 0i;
//#endfor
//#endfor
//#endfor

    for (var b = 0u; b < STAGES; b++) {
        {
//#for k in W_ITEMS
            if (w_live{{k}}) {
                w_s[w_dst{{k}}] = decode(w_reg{{k}}, 6u);
                w_s[w_dst{{k}} + 2u] = decode(w_reg{{k}}, 4u);
                w_s[w_dst{{k}} + 4u] = decode(w_reg{{k}}, 2u);
                w_s[w_dst{{k}} + 6u] = decode(w_reg{{k}}, 0u);
            }
//#endfor
//#for k in X_ITEMS
            if (x_live{{k}}) {
                x_s[x_dst{{k}}] = x_reg{{k}};
            }
//#endfor
        }
        workgroupBarrier();
        // The next stage's loads fly while this one is multiplied (the last round re-reads
        // stage STAGES-1, harmlessly, to keep the loads unconditional).
        let nb = min(b + 1u, STAGES - 1u);
//#for k in W_ITEMS
        w_reg{{k}} = weights[w_src{{k}} + nb * WV];
//#endfor
//#for k in X_ITEMS
        x_reg{{k}} = xq[x_src{{k}} + nb * SV];
//#endfor
//#for q in SV
        {
//#for m in MT
            let xv{{m}} = x_s[(ty + TY * {{m}}u) * STRIDE + {{q}}u];
//#endfor
//#for h in 2
//#for i in MRH
            let wv{{h}}{{i}} = w_s[(tx + TX * ({{h}}u * MRH + {{i}}u)) * STRIDE + {{q}}u];
//#for m in MT
            acc{{h}}{{i}}_{{m}} += dot16(wv{{h}}{{i}}, xv{{m}});
//#endfor
//#endfor
//#endfor
        }
//#endfor
        workgroupBarrier();
    }

//#for m in MT
    {
        let t = t0 + ty + TY * {{m}}u;
        if (t < n_tokens) {
            let xs = xscale[t];
            if (GATED) {
//#for i in MRH
                {
                    let o = rt * OUT_TILE + tx + TX * {{i}}u;
                    if (o < OUT_W) {
                        let gv = wscale[o] * xs * f32(acc0{{i}}_{{m}});
                        let uv = wscale[HALF + o] * xs * f32(acc1{{i}}_{{m}});
                        store_out(t * OUT_W + o, gv, uv);
                    }
                }
//#endfor
            } else {
//#for h in 2
//#for i in MRH
                {
                    let n = rt * RT + tx + TX * ({{h}}u * MRH + {{i}}u);
                    if (n < N) {
                        store_out(t * OUT_W + n, wscale[n] * xs * f32(acc{{h}}{{i}}_{{m}}), 0.0);
                    }
                }
//#endfor
//#endfor
            }
        }
    }
//#endfor
}
