// Snippet (//#include _row_dots): statements of a ternary GEMV's main, the dot products of one token
// row. In: ITERS chunks per thread, each with `live{it}` (inside the row), weights `w{it}_{r}` of the
// ROWS rows and activation words `x{it}_0..3`; word_sum / block_dot of _ternary_codes. Out: a{r} -
// xsum is this thread's exact integer partial of row r (code - 1 = value); with SUBGROUPS, s{r} is
// that partial summed over the subgroup.
var xsum = 0i;
//#for r in ROWS
var a{{r}} = 0i;
//#endfor
//#for it in ITERS
if (live{{it}}) {
    xsum += word_sum(x{{it}}_0) + word_sum(x{{it}}_1) + word_sum(x{{it}}_2) + word_sum(x{{it}}_3);
//#for r in ROWS
    a{{r}} += block_dot(w{{it}}_{{r}}, x{{it}}_0, x{{it}}_1, x{{it}}_2, x{{it}}_3);
//#endfor
}
//#endfor
//#if SUBGROUPS
//#for r in ROWS
let s{{r}} = subgroupAdd(a{{r}} - xsum);
//#endfor
//#endif
