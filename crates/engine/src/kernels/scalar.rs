//! The scalar types the CPU kernels are generic over: [`Acc`], the accumulation scalar (f32, or
//! f64 on the reference path) with its row kernels (softmax, exp, max; vectorised for f32 by
//! [`super::vecmath`]), and [`Elem`], the conversion between a storage element (f32, f64, bf16,
//! f16) and an accumulation scalar.

/// Accumulation scalar of the CPU kernels (f32 or f64).
pub(crate) trait Acc:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn from_f64(v: f64) -> Self;
    /// Softmax of each row of `n` values, in place.
    fn softmax_rows(x: &mut [Self], n: usize);
    /// Row i of `x` (rows of `n`) becomes `e^(x − sub[i])`, in place.
    fn exp_rows(x: &mut [Self], n: usize, sub: &[Self]);
    /// The row's maximum (−∞ when empty).
    fn max_of(row: &[Self]) -> Self;
    /// `row[j] = e^(row[j] − m)` in place; returns their sum.
    fn exp_sub_sum(row: &mut [Self], m: Self) -> Self;
}

/// The scalar row kernels (the f64 reference path).
fn scalar_max<A: Acc>(row: &[A]) -> A {
    let mut m = A::NEG_INF;
    for v in row.iter() {
        if *v > m {
            m = *v;
        }
    }
    m
}

fn scalar_exp_sub_sum<A: Acc>(row: &mut [A], m: A) -> A {
    let mut z = A::ZERO;
    for v in row.iter_mut() {
        *v = (*v - m).exp();
        z += *v;
    }
    z
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn softmax_rows(x: &mut [f32], n: usize) {
        super::vecmath::softmax_rows(x, n)
    }
    fn exp_rows(x: &mut [f32], n: usize, sub: &[f32]) {
        super::vecmath::exp_rows(x, n, sub)
    }
    fn max_of(row: &[f32]) -> f32 {
        super::vecmath::max_of(row)
    }
    fn exp_sub_sum(row: &mut [f32], m: f32) -> f32 {
        super::vecmath::exp_sub_sum_of(row, m)
    }
}

impl Acc for f64 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn softmax_rows(x: &mut [f64], n: usize) {
        for row in x.chunks_mut(n.max(1)) {
            let m = scalar_max(row);
            let inv = 1.0 / scalar_exp_sub_sum(row, m);
            for v in row.iter_mut() {
                *v *= inv;
            }
        }
    }
    fn exp_rows(x: &mut [f64], n: usize, sub: &[f64]) {
        for (row, &m) in x.chunks_mut(n.max(1)).zip(sub) {
            for v in row.iter_mut() {
                *v = (*v - m).exp();
            }
        }
    }
    fn max_of(row: &[f64]) -> f64 {
        scalar_max(row)
    }
    fn exp_sub_sum(row: &mut [f64], m: f64) -> f64 {
        scalar_exp_sub_sum(row, m)
    }
}

/// Conversion between a storage element and an accumulation scalar.
pub(crate) trait Elem<A>: Copy {
    fn to_acc(self) -> A;
    fn from_acc(a: A) -> Self;
}

macro_rules! elem {
    ($t:ty, $a:ty, $to:expr, $from:expr) => {
        impl Elem<$a> for $t {
            #[inline]
            fn to_acc(self) -> $a {
                $to(self)
            }
            #[inline]
            fn from_acc(a: $a) -> Self {
                $from(a)
            }
        }
    };
}
elem!(f32, f32, |x| x, |a| a);
elem!(f64, f64, |x| x, |a| a);
// bf16 from f32 by `vecmath::bf16_bits`: the bits of `half::bf16::from_f32` (round to nearest
// even, NaN quieted with 0x40), branch-free so the row kernels vectorise it.
elem!(half::bf16, f32, half::bf16::to_f32, |a| {
    half::bf16::from_bits(super::vecmath::bf16_bits(a))
});
elem!(half::f16, f32, half::f16::to_f32, half::f16::from_f32);
// Mixed pairs (an f64 accumulation of a narrower storage and back), so kernels with an input and
// an output dtype can be instantiated for every pair.
elem!(f32, f64, f64::from, |a: f64| a as f32);
elem!(f64, f32, |x: f64| x as f32, f64::from);
elem!(half::bf16, f64, half::bf16::to_f64, half::bf16::from_f64);
elem!(half::f16, f64, half::f16::to_f64, half::f16::from_f64);
