//! A least-squares line through samples: the delay's fit of a step's pace.

use std::collections::VecDeque;

/// The least-squares line through samples (x, y): their means, variances and covariance.
#[derive(Clone, Copy, Debug)]
pub struct Line {
    pub n: f64,
    pub mean_x: f64,
    pub mean_y: f64,
    pub var_x: f64,
    pub var_y: f64,
    pub cov: f64,
}

impl Line {
    pub fn through(samples: &VecDeque<(f64, f64)>) -> Self {
        let n = samples.len() as f64;
        let mean_x = samples.iter().map(|(x, _)| x).sum::<f64>() / n;
        let mean_y = samples.iter().map(|(_, y)| y).sum::<f64>() / n;
        let mean = |f: &dyn Fn(f64, f64) -> f64| samples.iter().map(|&(x, y)| f(x, y)).sum::<f64>() / n;
        Self {
            n,
            mean_x,
            mean_y,
            var_x: mean(&|x, _| (x - mean_x).powi(2)),
            var_y: mean(&|_, y| (y - mean_y).powi(2)),
            cov: mean(&|x, y| (x - mean_x) * (y - mean_y)),
        }
    }

    pub fn slope(&self) -> f64 {
        self.cov / self.var_x
    }

    /// The share of y's variance the line explains (R²).
    pub fn explained(&self) -> f64 {
        self.cov * self.cov / (self.var_x * self.var_y)
    }

    /// The slope's standard error: the spread of what the line leaves unexplained, over
    /// the spread of x (0 where it explains everything).
    pub fn slope_error(&self) -> f64 {
        let unexplained = (self.var_y - self.cov * self.cov / self.var_x).max(0.0);
        (unexplained / ((self.n - 2.0) * self.var_x)).sqrt()
    }

    /// The square of the slope's t: R² (n − 2) / (1 − R²).
    pub fn t_squared(&self) -> f64 {
        let explained = self.explained();
        if explained < 1.0 { explained * (self.n - 2.0) / (1.0 - explained) } else { f64::INFINITY }
    }
}
