// Snippet (//#include _ternary_codes): int8 dot products over packed I2_S codes, shared by the
// ternary kernels. Codes 0, 1, 2 in each 2-bit field (value + 1); byte b of a 16-byte load holds
// the values at shifts 6, 4, 2, 0 (see kernels/linear.py). DOT4 selects dot4I8Packed (_int8).

const CODE_MASK: u32 = 0x03030303u;  // the low 2-bit field of each byte
const ONES: u32 = 0x01010101u;

//#include _int8

// sum(code * x) over one 16-byte weight load (64 values) and its four vec4 of int8 inputs (the
// inputs of shift groups 6, 4, 2, 0); subtract word_sum of the inputs to get sum(value * x).
fn block_dot(w: vec4<u32>, x0: vec4<u32>, x1: vec4<u32>, x2: vec4<u32>, x3: vec4<u32>) -> i32 {
    let c0 = (w >> vec4<u32>(6u)) & vec4<u32>(CODE_MASK);
    let c1 = (w >> vec4<u32>(4u)) & vec4<u32>(CODE_MASK);
    let c2 = (w >> vec4<u32>(2u)) & vec4<u32>(CODE_MASK);
    let c3 = w & vec4<u32>(CODE_MASK);
    return dot4(c0.x, x0.x) + dot4(c0.y, x0.y) + dot4(c0.z, x0.z) + dot4(c0.w, x0.w)
         + dot4(c1.x, x1.x) + dot4(c1.y, x1.y) + dot4(c1.z, x1.z) + dot4(c1.w, x1.w)
         + dot4(c2.x, x2.x) + dot4(c2.y, x2.y) + dot4(c2.z, x2.z) + dot4(c2.w, x2.w)
         + dot4(c3.x, x3.x) + dot4(c3.y, x3.y) + dot4(c3.z, x3.z) + dot4(c3.w, x3.w);
}

fn word_sum(x: vec4<u32>) -> i32 {
    return dot4(ONES, x.x) + dot4(ONES, x.y) + dot4(ONES, x.z) + dot4(ONES, x.w);
}
