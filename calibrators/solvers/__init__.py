"""The solvers the methods share: the penalised softmax regression, the cross-validated
walk along a penalty path, and the tempered NLL with its derivatives."""
