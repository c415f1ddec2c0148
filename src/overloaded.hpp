// Overloaded: a visitor made of lambdas, for std::visit over the request and reply variants.
#pragma once

namespace softkv::detail {

/// Inherits every lambda's call operator.
template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

}  // namespace softkv::detail
