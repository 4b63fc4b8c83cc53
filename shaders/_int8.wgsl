// Snippet (//#include _int8): words of four signed int8 values (byte 0 first): packing, unpacking,
// dot products. DOT4 selects WGSL's dot4I8Packed (language feature packed_4x8_integer_dot_product;
// kernels/common.py packed_dot_available); without it, shifts and multiplies give the same value.

//#if DOT4
fn dot4(a: u32, b: u32) -> i32 {
    return dot4I8Packed(a, b);
}
//#else
fn dot4(a: u32, b: u32) -> i32 {
    let p = bitcast<i32>(a);
    let q = bitcast<i32>(b);
    return ((p << 24u) >> 24u) * ((q << 24u) >> 24u) + ((p << 16u) >> 24u) * ((q << 16u) >> 24u)
         + ((p << 8u) >> 24u) * ((q << 8u) >> 24u) + (p >> 24u) * (q >> 24u);
}
//#endif

// Four integral floats in -128..127 -> one word.
fn pack_i8(q: vec4<f32>) -> u32 {
    let b = bitcast<vec4<u32>>(vec4<i32>(q)) & vec4<u32>(0xffu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

// One word -> its four values, sign-extended.
fn int8x4(word: u32) -> vec4<f32> {
    let w = bitcast<i32>(word);
    return vec4<f32>(f32((w << 24u) >> 24u), f32((w << 16u) >> 24u), f32((w << 8u) >> 24u), f32(w >> 24u));
}
