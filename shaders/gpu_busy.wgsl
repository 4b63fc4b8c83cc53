// Arithmetic that keeps every SM busy for a while and touches no memory a reply reads: the GPU
// warm-up's filler (model/warm_up.py). A small model's LM head takes microseconds, too little work for
// the GPU to raise its clocks again after an idle spell; this kernel gives it that work on any model.
//
//   four independent FMA chains of ITERS steps per invocation; the result is written only if it
//   equals a value it never reaches, so the compiler keeps the loop and `sink` stays zero
//
// Bindings:
//   0 sink  [1] f32  never written in practice (a test checks it stays zero)
//
// Dispatch: (WORKGROUPS, 1, 1), each of WG invocations: as many as fill a large GPU, few on a CPU adapter.

const ITERS: u32 = ${ITERS};
const WG: u32 = ${WG};

@group(0) @binding(0) var<storage, read_write> sink: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var a = f32(gid.x & 1023u) * 1.0e-3;
    var b = a + 0.25;
    var c = a + 0.5;
    var d = a + 0.75;
    for (var i = 0u; i < ITERS; i++) {
        // contractions towards 1: every value stays in [0, 1.01]
        a = fma(a, 0.999, 0.001);
        b = fma(b, 0.998, 0.002);
        c = fma(c, 0.997, 0.003);
        d = fma(d, 0.996, 0.004);
    }
    if (a + b + c + d > 1.0e30) {
        sink[0] = a + b + c + d;
    }
}
